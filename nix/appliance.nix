# The project-authored, builtins-only part of the flake: unit texts, the env file, the deploy wrapper, the
# offline check. It imports nothing (no nixpkgs), so Nix 2.8 evaluates it offline and CI checks it:
#   nix-instantiate --eval --strict --json nix/appliance.nix -A units
# The Python renderer (dsv41 render-units) produces the same unit text from the same templates.
{ root ? ./.. }:
let
  systemdDir = root + "/systemd";
  isTemplate = name: builtins.match ".*\\.in" name != null;
  templates = builtins.filter isTemplate (builtins.attrNames (builtins.readDir systemdDir));
  unitName = template: builtins.substring 0 (builtins.stringLength template - 3) template;
  render = prefix: template:
    builtins.replaceStrings [ "@PREFIX@" ] [ prefix ] (builtins.readFile (systemdDir + "/${template}"));
in
rec {
  # The stable path every unit refers to; deploy points it at each new build (one generation per deploy).
  profile = "/nix/var/nix/profiles/dsv41";

  systems = [ "aarch64-linux" "x86_64-linux" ];

  # GB10 (DGX Spark) is sm_121, CUDA 13 only; x86_64 covers Hopper for development plus Ada/Blackwell boxes.
  cudaCapabilities = {
    aarch64-linux = [ "12.1" ];
    x86_64-linux = [ "9.0" "8.9" "12.0" ];
  };

  renderUnits = prefix: builtins.listToAttrs
    (map (template: { name = unitName template; value = render prefix template; }) templates);

  units = renderUnits profile;

  unitNames = builtins.attrNames units;

  envExample = builtins.readFile (root + "/config/dsv41.env.example");

  # The service user (systemd-sysusers) and its polkit rule, as deploy installs them: a NixOS host can take these
  # (environment.etc."sysusers.d/dsv41.conf", security.polkit.extraConfig) instead.
  sysusers = builtins.readFile (systemdDir + "/dsv41.sysusers");
  polkitRules = builtins.readFile (systemdDir + "/dsv41.rules");

  # Shell lines that write the rendered units into $out/lib/systemd/system; used by the nixpkgs package and by the
  # offline check below, so both install exactly the same files. Unit names contain '@', which store paths do
  # not allow, so the texts travel as environment variables rather than builtins.toFile.
  unitEnv = prefix: builtins.listToAttrs (builtins.genList
    (i: { name = "dsv41Unit${toString i}"; value = (renderUnits prefix).${builtins.elemAt unitNames i}; })
    (builtins.length unitNames));

  installUnitsScript = ''
    mkdir -p "$out/lib/systemd/system"
  '' + builtins.concatStringsSep "" (builtins.genList
    (i: ''
      printf '%s' "$dsv41Unit${toString i}" > "$out/lib/systemd/system/${builtins.elemAt unitNames i}"
    '')
    (builtins.length unitNames));

  # `nix run .#deploy -- ...` runs this: the deploy program (stdlib-only Python, no torch needed on the deploying
  # machine) from the same source, told which flake to build. `flake` is the flake's store path, so the build
  # uses exactly the source the app came from.
  deployScript = { python, flake }: ''
    #!/bin/sh
    # dsv41 deploy: build the closure, copy it to both Sparks, switch the profile, restart, gate, roll back.
    export PYTHONPATH=${flake}/src''${PYTHONPATH:+:$PYTHONPATH}
    exec ${python} -m dsv41.ops.deploy --flake ${flake} "$@"
  '';

  # Builds with nothing but /bin/sh and the host's systemd-analyze (sandbox off, as Debian's Nix 2.8 ships):
  # renders the units with a prefix holding an executable bin/dsv41 and requires `systemd-analyze verify` to be
  # completely silent. CI: nix build --option substituters '' .#checks.<system>.units-offline
  offlineUnitsCheck = system: derivation ({
    name = "dsv41-units-verify";
    inherit system;
    builder = "/bin/sh";
    PATH = "/usr/bin:/bin";
    args = [ "-c" ''
      set -e
      ${installUnitsScript}
      prefix="$out/prefix"
      mkdir -p "$prefix/bin" "$prefix/libexec/dsv41"
      cp /bin/true "$prefix/bin/dsv41"
      mkdir -p "$out/verify"
      cd "$out/lib/systemd/system"
      for unit in *; do
        sed "s|${profile}|$prefix|g" "$unit" > "$out/verify/$unit"
      done
      cd "$out/verify"
      systemd-analyze verify ./* > "$out/verify.log" 2>&1
      if [ -s "$out/verify.log" ]; then cat "$out/verify.log" >&2; exit 1; fi
    '' ];
  } // unitEnv profile);
}
