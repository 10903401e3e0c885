"""Causal SDPA for the published MegaTrain where flash-attn is not installed.

MegaTrain (infinity/model/cpu_master.py) hands each decoder layer the batch's 2-D padding
mask (B, T) as `attention_mask`, which only transformers' `flash_attention_2` path takes;
transformers' SDPA path wants a 4-D float or bool mask and refuses it. MegaTrain accepts only
"flash_attention_2", "sdpa" or "eager", and transformers loads "flash_attention_2" only where
flash-attn is installed; so benches/compare/run.sh puts this directory on MegaTrain's
PYTHONPATH only (no other process sees it), its config says "sdpa", and here "sdpa" is
registered over transformers' own as causal attention by torch's SDPA (its flash / cuDNN
kernels on an H100 or H200): what flash_attention_2 computes for rows without padding. The compare rows
are never padded (every row is `seq` tokens long, make_inputs.py), so the 2-D mask is all ones
and is not read (reading it would cost a device sync per layer).
"""

try:
    import torch
    from transformers import AttentionInterface

    def megatrain_causal_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # query (B, Hq, T, D); key, value (B, Hkv, T, D) with Hq a multiple of Hkv.
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, is_causal=True, scale=scaling,
            enable_gqa=key.shape[1] != query.shape[1],
        )
        return out.transpose(1, 2).contiguous(), None  # (B, T, Hq, D), no weights

    AttentionInterface.register("sdpa", megatrain_causal_sdpa)
except ImportError:  # a Python without torch or transformers: nothing to register
    pass
