# The profile deploy installs (/nix/var/nix/profiles/dsv41): bin/dsv41, the kernels, the rendered units, a C
# compiler for Triton's JIT launchers, docs and the env example, in one store path.
{ lib, symlinkJoin, stdenv, dsv41, dsv41-kernels, appliance }:
symlinkJoin ({
  name = "dsv41-appliance-${dsv41.version}";
  paths = [ dsv41 dsv41-kernels ];
  postBuild = appliance.installUnitsScript + ''
    mkdir -p "$out/libexec/dsv41"
    ln -s ${stdenv.cc}/bin/cc "$out/libexec/dsv41/cc"
  '';
  passthru = { inherit dsv41 dsv41-kernels; units = appliance.units; };
  meta.mainProgram = "dsv41";
} // appliance.unitEnv appliance.profile)
