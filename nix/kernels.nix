# dsv41-kernels: the kernel sources and their ahead-of-time cubins, built reproducibly into the closure.
# The CUDA EXL3 kernels (src/dsv41/kernels/cuda/*.cu) are compiled here with nvcc for the configured
# cudaCapabilities (12.1 on the Sparks), every variant the engine can ask for, by the same torch-free script the
# runtime uses to name them (src/dsv41/kernels/cuda_build.py); the units set DSV41_CUBIN_DIR to
# $out/share/dsv41/cuda, so a node compiles nothing at start. The Triton kernels (the portable path) are
# JIT-compiled on the node, so for them the closure carries the exact sources.
{ lib, cudaPackages, python3 }:
let
  root = ../.;
  kernelsSrc = root + "/src/dsv41/kernels";
  baseArchs = map (c: "sm_" + lib.replaceStrings [ "." ] [ "" ] c) cudaPackages.flags.cudaCapabilities;
  # Hopper's own image beside the portable one: the wgmma prefill tiles (kernels/exl3/prefill_wgmma.py)
  archs = baseArchs ++ lib.optional (lib.elem "sm_90" baseArchs) "sm_90a";
  archFlags = lib.concatMapStringsSep " " (a: "--arch ${a}") archs;
in
assert lib.assertMsg (archs != [ ]) "dsv41-kernels: config.cudaCapabilities is empty";
cudaPackages.backendStdenv.mkDerivation {
  pname = "dsv41-kernels";
  version = "0.1.0";
  src = lib.fileset.toSource {
    inherit root;
    fileset = kernelsSrc;
  };
  __structuredAttrs = true;
  strictDeps = true;
  nativeBuildInputs = [ cudaPackages.cuda_nvcc python3 ];
  buildPhase = ''
    runHook preBuild
    DSV41_NVCC="$(command -v nvcc)" python3 src/dsv41/kernels/cuda_build.py ${archFlags} \
      --out build/cuda --jobs "$NIX_BUILD_CORES"
    runHook postBuild
  '';
  installPhase = ''
    runHook preInstall
    mkdir -p "$out/share/dsv41/cuda" "$out/share/dsv41/kernels/src"
    cp build/cuda/*.cubin "$out/share/dsv41/cuda/"
    cp -r src/dsv41/kernels/. "$out/share/dsv41/kernels/src/"
    runHook postInstall
  '';
  passthru = { inherit archs; };
  meta.platforms = [ "aarch64-linux" "x86_64-linux" ];
}
