"""A tiny, fully local character-level tokenizer for the built-in demo models.

Built with the ``tokenizers`` library (a BPE model with no merges, so every character is one
token) and wrapped in ``transformers.PreTrainedTokenizerFast``, so it saves and loads with
``save_pretrained`` / ``AutoTokenizer.from_pretrained`` like any hub tokenizer and supports
``apply_chat_template``. Ids: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, then the
characters. ``pad != eos`` on purpose: engines and trainers can tell padding from a finished
sequence.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

__all__ = ["SPECIAL_TOKENS", "CHAR_VOCAB", "CHAT_TEMPLATE", "build_char_tokenizer"]

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHAR_VOCAB = tuple(string.digits + "+-*/=() " + string.ascii_lowercase + ".,:;?!'#\n")

# One line per message ("user: ...\n"); assistant turns end with <eos> so SFT learns to stop.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _vocab() -> dict[str, int]:
    tokens = list(SPECIAL_TOKENS) + list(CHAR_VOCAB)
    return {token: index for index, token in enumerate(tokens)}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Return a fresh character-level tokenizer (no files, no network)."""
    backend = Tokenizer(BPE(vocab=_vocab(), merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
