# dsv41-kernels: the kernel sources and their ahead-of-time objects, built reproducibly into the closure.
# Triton kernels are JIT-compiled on the node (dsv41-warm@ fills TRITON_CACHE_DIR, which needs the GPU), so for them
# the closure carries the exact sources. CUDA sources under kernels/ (*.cu) are compiled here with nvcc for the
# configured cudaCapabilities (12.1 on the Sparks) into one shared object each.
{ lib, cudaPackages }:
let
  root = ../.;
  kernelsDir = root + "/kernels";
  tritonDir = root + "/src/dsv41/kernels";
  hasKernelsDir = builtins.pathExists kernelsDir;
  kernelFiles = lib.optionals hasKernelsDir (lib.filesystem.listFilesRecursive kernelsDir);
  cuSources = map (f: lib.removePrefix (toString kernelsDir + "/") (toString f))
    (builtins.filter (f: lib.hasSuffix ".cu" (toString f)) kernelFiles);
  archs = map (lib.replaceStrings [ "." ] [ "" ]) cudaPackages.flags.cudaCapabilities;
  gencode = lib.concatMapStringsSep " " (a: "-gencode=arch=compute_${a},code=sm_${a}") archs;
in
assert lib.assertMsg (archs != [ ]) "dsv41-kernels: config.cudaCapabilities is empty";
cudaPackages.backendStdenv.mkDerivation {
  pname = "dsv41-kernels";
  version = "0.1.0";
  src = lib.fileset.toSource {
    inherit root;
    fileset = lib.fileset.unions ([ tritonDir ] ++ lib.optional hasKernelsDir kernelsDir);
  };
  __structuredAttrs = true;
  strictDeps = true;
  nativeBuildInputs = lib.optionals (cuSources != [ ]) [ cudaPackages.cuda_nvcc ];
  buildInputs = lib.optionals (cuSources != [ ]) [ cudaPackages.cuda_cudart ];
  buildPhase = ''
    runHook preBuild
  '' + lib.concatMapStrings (rel: ''
    mkdir -p "build/$(dirname ${rel})"
    nvcc -O3 -std=c++17 -Xcompiler -fPIC -shared ${gencode} -o "build/${lib.removeSuffix ".cu" rel}.so" "kernels/${rel}"
  '') cuSources + ''
    runHook postBuild
  '';
  installPhase = ''
    runHook preInstall
    mkdir -p "$out/share/dsv41/kernels/triton"
    cp -r src/dsv41/kernels/. "$out/share/dsv41/kernels/triton/"
    if [ -d kernels ]; then mkdir -p "$out/share/dsv41/kernels/src"; cp -r kernels/. "$out/share/dsv41/kernels/src/"; fi
    if [ -d build ]; then mkdir -p "$out/lib/dsv41-kernels"; cp -r build/. "$out/lib/dsv41-kernels/"; fi
    runHook postInstall
  '';
  passthru = { inherit cuSources archs; };
  meta.platforms = [ "aarch64-linux" "x86_64-linux" ];
}
