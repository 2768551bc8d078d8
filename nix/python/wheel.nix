# One upstream binary wheel made to work under Nix, the hf-nix way: autoPatchelf resolves every DT_NEEDED
# against Nix store libraries (CUDA from cudaPackages, libstdc++ from the toolchain), the driver runpath
# (/run/opengl-driver/lib) is appended for libcuda, and libcuda.so.1 itself stays unresolved: it must come from the
# host's driver at run time. Called by ./overlay.nix for torch, triton, xgrammar and apache-tvm-ffi.
{ lib, stdenv, buildPythonPackage, fetchurl, python, autoPatchelfHook, autoAddDriverRunpath }:
{ pname
, pin                   # an entry of ./wheels.nix: { version; <system> = { url; sha256; }; }
, buildInputs ? [ ]
, dependencies ? [ ]
, ignoreMissing ? [ ]   # libraries provided at run time by the host driver or another wheel's loader
, searchPaths ? [ ]     # directories inside this wheel holding its own bundled .so files
, runpaths ? [ ]        # extra RUNPATH entries for libraries the wheel dlopen()s (autoPatchelf cannot see those)
, passthru ? { }
, importsCheck ? [ ]
}:
let
  system = stdenv.hostPlatform.system;
  wheel = pin.${system} or (throw "${pname}: no wheel pinned for ${system} in nix/python/wheels.nix");
in
assert lib.assertMsg (python.pythonVersion == "3.13")
  "${pname}: nix/python/wheels.nix pins cp313 wheels but this python is ${python.pythonVersion}";
buildPythonPackage {
  inherit pname dependencies buildInputs passthru;
  version = pin.version;
  format = "wheel";
  src = fetchurl { inherit (wheel) url sha256; };
  nativeBuildInputs = [ autoPatchelfHook autoAddDriverRunpath ];
  autoPatchelfIgnoreMissingDeps = ignoreMissing;
  appendRunpaths = runpaths;
  preFixup = lib.concatMapStrings (dir: ''
    addAutoPatchelfSearchPath "$out/${python.sitePackages}/${dir}"
  '') searchPaths;
  # Stripping breaks the CUDA fatbins in torch's libraries.
  dontStrip = true;
  # The wheels' METADATA names pip's nvidia-* CUDA wheels; their libraries come from cudaPackages here instead.
  dontCheckRuntimeDeps = true;
  pythonImportsCheck = importsCheck;
}
