"""Whether this interpreter can give a torchao reference, for the scripts
that write one (fp8_torchao_reference.py, mx_torchao_reference.py): the
Debian legs' Pythons lack float8 dtypes, safetensors or torchao, and there
the scripts write why instead, for the C++ tests to skip with."""
import importlib
import sys

import torch


def why_not(module, dtypes, dtype_kind):
    """None when torch has every dtype named in `dtypes`, safetensors imports
    and torchao's `module` imports; else why not, in words."""
    if not all(hasattr(torch, d) for d in dtypes):
        return "torch %s has no %s dtypes" % (torch.__version__, dtype_kind)
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        return "no safetensors package for %s" % sys.executable
    try:
        importlib.import_module(module)
    except ImportError as e:
        return "no torchao for %s (%s)" % (sys.executable, e)
    return None
