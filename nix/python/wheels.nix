# Upstream wheels, pinned by URL and sha256 (PyPI's published digests). torch 2.13.0 on PyPI is the CUDA 13.0
# build for both linux architectures (its METADATA requires nvidia-*-cu13); the nvidia-* wheels it names are NOT
# used: their libraries come from nixpkgs' cudaPackages instead (hf-nix's approach), libcuda from the host driver.
# Python 3.13 (cp313) = nixpkgs' default python3.
{
  torch = {
    version = "2.13.0";
    aarch64-linux = {
      url = "https://files.pythonhosted.org/packages/11/18/9ecb37b56293a0be8d80f810bf672a72fe7e02f8b475d5ef1b9bf8a0d748/torch-2.13.0-cp313-cp313-manylinux_2_28_aarch64.whl";
      sha256 = "1e09d6a722504957c694faceca843acde562786df1144ebcc5a74075ec7f6005";
    };
    x86_64-linux = {
      url = "https://files.pythonhosted.org/packages/d4/5a/7c50ba1b7b713d71d34669c6d13dab0a11531a3eceb0307a5162dbfec0f7/torch-2.13.0-cp313-cp313-manylinux_2_28_x86_64.whl";
      sha256 = "a3a9a21312872af8a26950b2c15680335a386a1f56ed03e780653d78b9607e9e";
    };
  };
  # the triton version torch 2.13.0 pins (Requires-Dist: triton==3.7.1)
  triton = {
    version = "3.7.1";
    aarch64-linux = {
      url = "https://files.pythonhosted.org/packages/00/42/c5089d4d9327fcd1e862c599cc2927f39418f84dd11a84cb2ccff9d4787a/triton-3.7.1-cp313-cp313-manylinux_2_27_aarch64.manylinux_2_28_aarch64.whl";
      sha256 = "cdbfc09d9ec58bc5e68321525653220de7515c199e7a8097a97c85e62b52cd0a";
    };
    x86_64-linux = {
      url = "https://files.pythonhosted.org/packages/07/42/2c3ac59253ae8892b6f307875263dd23dc875cdf732d3aea40d6d41fb7cb/triton-3.7.1-cp313-cp313-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl";
      sha256 = "58c0e131da05134a2a4788ccbcc0c1105cf0f54c8e98f19e34cd465396dc15eb";
    };
  };
  # nixpkgs builds xgrammar from source and marks aarch64-linux bad (GCC -Werror): use the wheel everywhere.
  xgrammar = {
    version = "0.2.9";
    aarch64-linux = {
      url = "https://files.pythonhosted.org/packages/bc/25/34e85e8c878286233fb9ecab26ad58948af8d3b104df1e27478f307adef3/xgrammar-0.2.9-cp313-cp313-manylinux_2_26_aarch64.manylinux_2_28_aarch64.whl";
      sha256 = "454d6f0db15dabda6a7735801e0d0ed4685404e1100bcf2e1cacaae50c3f1344";
    };
    x86_64-linux = {
      url = "https://files.pythonhosted.org/packages/30/ae/9e4ca46a3ccc542b74c86f9422fcd0d35141e1af2da526227a4ee686341a/xgrammar-0.2.9-cp313-cp313-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl";
      sha256 = "fd18ee20065863cfe2eb9947e6bbf515ae1966ced1352f17799c0aa54dbb1ac4";
    };
  };
  apache-tvm-ffi = {
    version = "0.1.15.post2";
    aarch64-linux = {
      url = "https://files.pythonhosted.org/packages/83/c9/6256df9b64db1bd7e605ff7612690629a2adc8ebbf15a6c65f15e076a47b/apache_tvm_ffi-0.1.15.post2-cp313-cp313-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl";
      sha256 = "de48c255b2753fae02b06b6ca0a30742593e46c6828938a29eafb5e2ccff430f";
    };
    x86_64-linux = {
      url = "https://files.pythonhosted.org/packages/41/fb/70cc7fc2ab86b805089ff165e306a3ff550baa3672271a9d9a23f14ce6b6/apache_tvm_ffi-0.1.15.post2-cp313-cp313-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl";
      sha256 = "eae72eb5bcbbddbc68d54eb6c16af860c628ca2f2b02cc4af2693e01a8186f73";
    };
  };
}
