# Offline stand-in for the nixpkgs input, for CI on Debian's Nix 2.8 (no network, and too old for current
# nixpkgs). With `--override-input nixpkgs path:./nix/stub-nixpkgs` the dsv41 flake exposes only its builtins-only
# outputs (lib, checks.*.units-offline), which is exactly what can be evaluated and built there.
{
  description = "dsv41 offline nixpkgs stub (CI only)";
  outputs = { self }: { dsv41OfflineStub = true; };
}
