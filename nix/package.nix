# The dsv41 Python package (server, engine, ops commands) with the unit templates, env example and docs.
{ lib, buildPythonPackage, setuptools, wheel, torch, numpy, safetensors, tokenizers, starlette, hypercorn, pydantic
, prometheus-client, xgrammar, sdnotify, tqdm }:
let
  root = ../.;
in
buildPythonPackage {
  pname = "dsv41";
  version = "0.1.0";
  pyproject = true;
  # Only what the package needs: editing nix/, tests/ or bench/ does not rebuild it.
  src = lib.fileset.toSource {
    inherit root;
    fileset = lib.fileset.unions [
      (root + "/pyproject.toml")
      (root + "/src")
      (root + "/systemd")
      (root + "/config")
      (root + "/docs")
    ];
  };
  build-system = [ setuptools wheel ];
  dependencies = [
    torch numpy safetensors tokenizers starlette hypercorn pydantic prometheus-client xgrammar sdnotify tqdm
  ];
  postInstall = ''
    install -Dm644 -t "$out/share/dsv41/systemd" systemd/*.in systemd/dsv41.sysusers systemd/dsv41.rules
    install -Dm644 config/dsv41.env.example "$out/share/dsv41/dsv41.env.example"
    install -Dm644 -t "$out/share/doc/dsv41" docs/*.md
  '';
  # Imports that need no GPU; the CPU-side tests run in the flake's checks.
  pythonImportsCheck = [ "dsv41" "dsv41.ops.knobs" "dsv41.ops.watchdog" ];
  meta = {
    description = "DeepSeek-V4.1-Flash inference appliance (OpenAI-compatible, tensor-parallel over two DGX Sparks)";
    mainProgram = "dsv41";
    platforms = [ "aarch64-linux" "x86_64-linux" ];
  };
}
