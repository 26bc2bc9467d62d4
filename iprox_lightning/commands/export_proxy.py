"""Export a proxy as a dense Hugging Face model (each A·B as one weight) that plain from_pretrained loads."""
from __future__ import annotations


def export_proxy(proxy: str, output: str, dtype: str | None = None, overwrite: bool = False) -> str:
    """Write the proxy as a dense Hugging Face model: every low-rank layer ``A·B`` becomes one weight, saved with
    ``save_pretrained`` (safetensors) plus the tokenizer, so ``AutoModelForCausalLM.from_pretrained(output)``
    loads it and gives the proxy's logits (checked before the export is moved into place). ``iprox_export.json``
    records the proxy it came from (path, manifest and weights digests). For influence scores keep using the proxy
    directory: a dense layer's gradients are not the proxy's factor gradients.

    Args:
        proxy: the proxy directory (iprox_proxy.json + iprox_proxy.safetensors).
        output: the directory to write; must not exist or be empty (see overwrite), and not be the proxy directory.
        dtype: dtype of the exported weights (float32, bfloat16, float16, float64); default: the proxy's.
        overwrite: replace the contents of a non-empty output directory (never a proxy directory).
    """
    from ..io.proxy import export_proxy as export  # lazy: --help

    out = export(proxy, output, dtype=dtype, overwrite=overwrite)
    print(f"export_proxy: wrote a dense Hugging Face model of {proxy} to {out} "
          f"(AutoModelForCausalLM.from_pretrained loads it; provenance in {out}/iprox_export.json)")
    return str(out)
