# nixpkgs overlay: CUDA 13 as the one cudaPackages (no mixed CUDA versions), torch/triton/xgrammar/tvm-ffi from
# pinned upstream wheels, and the dsv41 packages.
{ appliance }:
final: prev:
let
  lib = final.lib;
  pins = import ./wheels.nix;
  cuda = final.cudaPackages;
in
{
  cudaPackages = final.cudaPackages_13;

  pythonPackagesExtensions = prev.pythonPackagesExtensions ++ [
    (pyfinal: pyprev:
      let
        wheel = import ./wheel.nix {
          inherit (final) lib stdenv fetchurl autoPatchelfHook autoAddDriverRunpath;
          inherit (pyfinal) buildPythonPackage python;
        };
      in
      {
        triton = wheel {
          pname = "triton";
          pin = pins.triton;
          ignoreMissing = [ "libcuda.so.1" ];
        };

        torch = wheel {
          pname = "torch";
          pin = pins.torch;
          buildInputs = (with cuda; [
            cuda_cudart cuda_cupti cuda_nvrtc cuda_nvtx cudnn libcublas libcufft libcufile libcurand libcusolver
            libcusparse libcusparse_lt nccl
          ]) ++ lib.optional (cuda ? libnvshmem) cuda.libnvshmem;
          dependencies = with pyfinal; [
            filelock fsspec jinja2 networkx numpy setuptools sympy typing-extensions triton
          ];
          ignoreMissing = [ "libcuda.so.1" ];
          searchPaths = [ "torch/lib" ];
          # torch dlopen()s nvrtc (and its builtins) for JIT kernels; autoPatchelf only sees DT_NEEDED.
          runpaths = [ "${lib.getLib cuda.cuda_nvrtc}/lib" ];
          importsCheck = [ "torch" ];
          passthru = {
            cudaSupport = true;
            cudaCapabilities = final.config.cudaCapabilities;
            cudaPackages = cuda;
          };
        };

        apache-tvm-ffi = wheel {
          pname = "apache-tvm-ffi";
          pin = pins.apache-tvm-ffi;
          dependencies = [ pyfinal.typing-extensions ];
          importsCheck = [ "tvm_ffi" ];
        };

        xgrammar = wheel {
          pname = "xgrammar";
          pin = pins.xgrammar;
          dependencies = with pyfinal; [ apache-tvm-ffi numpy pydantic torch transformers typing-extensions ]
            ++ lib.optional final.stdenv.hostPlatform.isx86_64 triton;
          # libxgrammar_bindings.so needs libtvm_ffi.so without a RUNPATH; tvm_ffi loads its library first.
          ignoreMissing = [ "libtvm_ffi.so" ];
        };
      })
  ];

  dsv41 = final.python3Packages.callPackage ../package.nix { };
  dsv41-kernels = final.callPackage ../kernels.nix { };
  dsv41-appliance = final.callPackage ../appliance-env.nix { inherit appliance; };
}
