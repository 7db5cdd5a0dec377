"""Drop-in replacements for torch.nn.utils' gradient clipping, on the fused ops.

Switch with one import: ``from gradacc_ext.utils import clip_grad_norm_`` (same
signature, arguments, return value, warnings and exceptions as torch's).
"""

from .clip_grad import clip_grad_norm_, clip_grad_value_, clip_grads_with_norm_, get_total_norm

__all__ = ["clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_", "get_total_norm"]
