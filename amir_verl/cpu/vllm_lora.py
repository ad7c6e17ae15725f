"""vLLM-CPU's LoRA products when every token uses one adapter (patch 8 of :mod:`amir_verl.cpu.platform`, applied
in every vLLM process by :mod:`amir_verl.cpu.vllm_engine`).

vLLM's CPU LoRA path (``vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU``) computes each adapted layer's
shrink (x A^T) and expand (x B^T) with ``vllm.lora.ops.torch_ops``' ``bgmv_*`` functions (its ``sgmv_*``, for
prefill, call them too). Each gathers every token's adapter matrix, ``weights[indices]``, into a
[tokens, out, in] copy and contracts it with an einsum. A verl rollout with LoRA names one adapter for every
token (the policy's), so that gather copies one matrix once per token in each of the model's adapted layers:
with SmolLM2-135M's adapter, vLLM-CPU generated 4x slower than without one (64 against 257 tokens/s, 64
responses of 40 tokens on 2 cores). When every index is the same, the product is that one matrix's matmul;
otherwise upstream's function runs. Same indexing as upstream's gather (a -1 names the last slot there too).
"""

from __future__ import annotations

import functools

import torch


def one_adapter_product(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor | None:
    """``inputs`` [tokens, in] times ``weights[i]``^T for the one ``i`` that every entry of ``indices`` [tokens]
    holds -> [tokens, out] in ``dtype``; None if the tokens name different adapters, or the shapes are not
    one row per token. ``weights``: [slots, out, in] or [slots, 1, out, in], as vLLM stacks its adapters."""
    if inputs.ndim != 2 or indices.ndim != 1 or indices.numel() == 0 or inputs.shape[0] != indices.shape[0]:
        return None
    first = indices[0]
    if not bool((indices == first).all()):
        return None
    matrix = weights[first].to(dtype)
    if matrix.ndim == 3:
        matrix = matrix.squeeze(0)
    return inputs.to(dtype) @ matrix.T


def bgmv_shrink(upstream):
    """``output[:, :out] = scaling * inputs @ A^T``, upstream's ``bgmv_shrink``."""

    @functools.wraps(upstream)
    def shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        product = one_adapter_product(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
        if product is None:
            return upstream(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling)
        output_tensor[:, : product.shape[1]] = scaling * product

    return shrink


def bgmv_expand(upstream):
    """``output[:, :width] (+)= inputs @ B^T``, upstream's ``bgmv_expand`` (``width``: the narrower of the two,
    as adapter and model may pad differently)."""

    @functools.wraps(upstream)
    def expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
        product = one_adapter_product(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        if product is None or product.shape[0] != output_tensor.shape[0]:
            return upstream(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
        width = min(product.shape[1], output_tensor.shape[1])
        if add_inputs:
            output_tensor[:, :width] += product[:, :width]
        else:
            output_tensor[:, :width] = product[:, :width]

    return expand


def bgmv_expand_slice(upstream):
    """``output[:, offset:offset + size] (+)= inputs @ B^T``, upstream's ``bgmv_expand_slice``."""

    @functools.wraps(upstream)
    def expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size,
                     add_inputs=True):
        product = one_adapter_product(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        if product is None:
            return upstream(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size,
                            add_inputs)
        if add_inputs:
            output_tensor[:, slice_offset : slice_offset + slice_size] += product
        else:
            output_tensor[:, slice_offset : slice_offset + slice_size] = product

    return expand_slice


WRAPPERS = {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice}


def patch_cpu_lora_products(punica_cpu) -> None:
    """``vllm.lora.punica_wrapper.punica_cpu`` imported: the three ``bgmv_*`` functions wrapped where they are
    called from, ``vllm.lora.ops.torch_ops.lora_ops`` (its ``sgmv_*`` look them up there), the package's
    re-exports and ``punica_cpu`` (its decode methods call its own imported names)."""
    import vllm.lora.ops.torch_ops as torch_ops
    from vllm.lora.ops.torch_ops import lora_ops

    for name, wrap in WRAPPERS.items():
        upstream = getattr(lora_ops, name)
        if getattr(upstream, "_amir_cpu", False):
            continue
        patched = wrap(upstream)
        patched._amir_cpu = True
        for module in (lora_ops, torch_ops, punica_cpu):
            setattr(module, name, patched)
