"""``kvroute check-config``'s tokenizer warning: a vLLM/SGLang/llama.cpp model sized with OpenAI's tokenizer.

Without a tokenizer configured, every prompt is counted with ``cl100k_base``. That is right
for OpenAI models and off by 10-30% for Llama, Qwen, Mistral or DeepSeek text, more than the
routing safety margin covers. The gateway learns the ratio from answers' ``usage`` at run
time (``proxy.core.token_calibration``), but only after answers arrive: the config should say.
"""

from __future__ import annotations

import re

from proxy.config import Config

#: Model names that OpenAI's tokenizers count correctly (cl100k or o200k: within a few %).
_OPENAI = re.compile(r"^(gpt-|o\d|chatgpt-|text-embedding-|davinci|babbage)", re.IGNORECASE)
_SERVER_KINDS = ("vllm", "sglang", "llamacpp")
_DEFAULT_TOKENIZER = "cl100k_base"


def is_openai_model(name: str) -> bool:
    return bool(_OPENAI.match(name.rsplit("/", 1)[-1]))


def tokenizer_warnings(cfg: Config) -> list[str]:
    """One line per vLLM/SGLang/llama.cpp model that is counted with cl100k but is not an OpenAI model."""
    if cfg.sizing.tokenizer_file is not None or cfg.sizing.tokenizer != _DEFAULT_TOKENIZER:
        return []
    served: dict[str, list[str]] = {}
    for b in cfg.backends:
        if b.kind in _SERVER_KINDS:
            for model in b.models:
                served.setdefault(model, []).append(b.name)
    out = []
    for model, names in served.items():
        own = cfg.models.get(model)
        if own is not None and (own.tokenizer is not None or own.tokenizer_file is not None):
            continue
        if is_openai_model(model):
            continue
        out.append(
            f"warning: model {model!r} (backend {', '.join(names)}) has no tokenizer configured: "
            f"its prompts are counted with {_DEFAULT_TOKENIZER} (OpenAI's), which counts other "
            f"models' text 10-30% apart; set models.{model}.tokenizer_file to its tokenizer.json "
            "(a llama.cpp model: its .gguf file) "
            "(until then the gateway corrects by the ratio it learns from usage.prompt_tokens)"
        )
    return out
