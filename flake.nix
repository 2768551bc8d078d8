{
  description = "dsv41: DeepSeek-V4.1-Flash served tensor-parallel across two DGX Sparks (OpenAI-compatible API)";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-unstable";

  outputs = { self, nixpkgs }:
    let
      # Builtins only: unit texts, env file, deploy wrapper. Evaluates anywhere, including Nix 2.8 offline.
      appliance = import ./nix/appliance.nix { };
      forSystems = f: builtins.listToAttrs (map (system: { name = system; value = f system; }) appliance.systems);

      builtinsOutputs = {
        lib = { inherit (appliance) profile units unitNames envExample cudaCapabilities renderUnits; };
        checks = forSystems (system: { units-offline = appliance.offlineUnitsCheck system; });
      };

      # CI overrides nixpkgs with ./nix/stub-nixpkgs (Nix 2.8, no network): then only the builtins part exists.
      offline = nixpkgs ? dsv41OfflineStub;
      full = import ./nix/outputs.nix { inherit self nixpkgs appliance forSystems; };
    in
    if offline then builtinsOutputs else full // { inherit (builtinsOutputs) lib; };
}
