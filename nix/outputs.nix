# The outputs that need real nixpkgs (Nix >= 2.18, network or a binary cache): packages, apps, devShells, checks.
{ self, nixpkgs, appliance, forSystems }:
let
  pkgsFor = system: import nixpkgs {
    inherit system;
    config = {
      allowUnfree = true; # CUDA, cuDNN, NCCL licences
      cudaSupport = true;
      cudaCapabilities = appliance.cudaCapabilities.${system};
      cudaForwardCompat = false;
    };
    overlays = [ (import ./python/overlay.nix { inherit appliance; }) ];
  };

  opsTestFiles = [
    "tests/test_watchdog.py" "tests/test_notify.py" "tests/test_preflight.py" "tests/test_ops_canary_status.py"
    "tests/test_deploy_dry_run.py"
    "tests/test_systemd_units.py"
  ];
in
{
  overlays.default = import ./python/overlay.nix { inherit appliance; };

  packages = forSystems (system:
    let pkgs = pkgsFor system; in {
      dsv41 = pkgs.dsv41;
      dsv41-kernels = pkgs.dsv41-kernels;
      default = pkgs.dsv41-appliance;
    });

  apps = forSystems (system:
    let
      pkgs = pkgsFor system;
      app = name: text: {
        type = "app";
        program = "${pkgs.writeScript "dsv41-${name}" text}";
      };
    in
    {
      # Runs on the deploying machine (any system): stdlib Python only, builds the aarch64 closure on a Spark.
      deploy = app "deploy" (appliance.deployScript { python = "${pkgs.python3}/bin/python3"; flake = self; });
      serve = app "serve" ''
        #!/bin/sh
        exec ${pkgs.dsv41-appliance}/bin/dsv41 serve "$@"
      '';
      bench = app "bench" ''
        #!/bin/sh
        exec ${pkgs.dsv41-appliance}/bin/dsv41 bench "$@"
      '';
    });

  devShells = forSystems (system:
    let pkgs = pkgsFor system; in {
      default = pkgs.mkShell {
        inputsFrom = [ pkgs.dsv41 ];
        packages = [
          (pkgs.python3.withPackages (ps: with ps; [
            torch numpy safetensors tokenizers starlette hypercorn pydantic prometheus-client xgrammar sdnotify tqdm
            pytest pytest-timeout openai httpx jsonschema psutil
          ]))
          pkgs.systemd # systemd-analyze for the unit tests
          pkgs.cudaPackages.cuda_nvcc
        ];
        shellHook = ''
          export PYTHONPATH="$PWD/src''${PYTHONPATH:+:$PYTHONPATH}"
          export CC=${pkgs.stdenv.cc}/bin/cc
          export TRITON_LIBCUDA_PATH=/run/opengl-driver/lib
        '';
      };
    });

  checks = forSystems (system:
    let
      pkgs = pkgsFor system;
      python = pkgs.python3.withPackages (ps: with ps; [ pytest sdnotify httpx starlette hypercorn ]);
    in
    {
      # Unit files verified by the systemd nixpkgs ships (not the host's): same rule as CI, stderr must be empty.
      units = pkgs.runCommand "dsv41-units-verify"
        ({ nativeBuildInputs = [ pkgs.systemd ]; } // appliance.unitEnv "/build/prefix")
        (appliance.installUnitsScript + ''
          mkdir -p /build/prefix/bin && cp ${pkgs.coreutils}/bin/true /build/prefix/bin/dsv41
          cd "$out/lib/systemd/system"
          systemd-analyze verify ./* 2> verify.log
          if [ -s verify.log ]; then cat verify.log >&2; exit 1; fi
          rm verify.log
        '');
      # The torch-free ops tests (watchdog, notify, preflight, deploy dry run, unit rendering).
      ops-tests = pkgs.runCommand "dsv41-ops-tests"
        { nativeBuildInputs = [ python pkgs.systemd pkgs.util-linux ]; src = self; }
        ''
          cp -r "$src" source && chmod -R u+w source && cd source
          PYTHONPATH=src python -m pytest -q -p no:cacheprovider ${builtins.concatStringsSep " " opsTestFiles}
          touch "$out"
        '';
      dsv41 = pkgs.dsv41;
    });
}
