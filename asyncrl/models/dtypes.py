"""Parameter dtypes by their config names, and the keyword transformers takes them under."""

from __future__ import annotations

import torch
import transformers
from packaging.version import Version

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# transformers renamed ``torch_dtype`` to ``dtype`` in 4.56
DTYPE_KW = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
