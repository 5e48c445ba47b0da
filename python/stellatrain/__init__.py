# SPDX-License-Identifier: Apache-2.0
"""stellatrain for Python: the library's CPU kernels on torch tensors.

    import stellatrain.torch.optim
    opt = stellatrain.torch.optim.AdamW(model.parameters(), lr=1e-3)

The package is built from the C++ headers by the project's CMake build (python/CMakeLists.txt);
`stellatrain._native` is its compiled module.
"""
from ._native import version as __version__

__all__ = ["__version__"]
