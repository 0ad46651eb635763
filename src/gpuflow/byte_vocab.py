"""The vocabulary of gpuflow's byte-level text models: token ``i`` is byte ``i`` of the
UTF-8 text, and one of them ends a document.

The end-of-document token is byte 0xFF, which UTF-8 never uses: text always encodes
without it, so it needs no id of its own beyond the 256 and byte packs stay one byte a
token. Packing writes it between documents, a model learns where documents end, the
server stops a completion there, and the Hugging Face export names it as the
end-of-sequence, beginning-of-sequence and padding token, as tools reading the format
expect.
"""

from __future__ import annotations

BYTE_VOCAB_SIZE = 256
END_OF_DOCUMENT = 0xFF
END_OF_DOCUMENT_TEXT = "<|endoftext|>"  # its name in the exported tokenizer
