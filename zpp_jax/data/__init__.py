"""Data for `zpp train`: where the tokens come from (`corpus`), how text
becomes tokens (`tokenizer`), the train/validation windows (`dataset`),
fine-tuning examples (`examples`) and conversations (`chat`), and the
batches each process reads onto the mesh (`loader`)."""

from zpp_jax.data.chat import ChatTemplate, load_chat_template
from zpp_jax.data.corpus import TokenFiles, expand, load_text, read_text, stdlib_corpus
from zpp_jax.data.dataset import TokenDataset
from zpp_jax.data.examples import encode_records, read_records
from zpp_jax.data.loader import BatchLoader, host_to_global, local_rows
from zpp_jax.data.tokenizer import Tokenizer, make_tokenizer, train_bpe

__all__ = [
    "BatchLoader",
    "ChatTemplate",
    "TokenDataset",
    "TokenFiles",
    "Tokenizer",
    "encode_records",
    "expand",
    "host_to_global",
    "load_chat_template",
    "load_text",
    "local_rows",
    "make_tokenizer",
    "read_records",
    "read_text",
    "stdlib_corpus",
    "train_bpe",
]
