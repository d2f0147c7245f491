"""Data: corpora -> tokenizer -> packed token files -> per-rank batches.

    prepared = prepare_corpus(cfg.data, cfg.model.vocab_size)       # cached after the first call
    train = TokenDataset(prepared.train_path, prepared.dtype, cfg.data.seq_len)
    sampler = GlobalBatchSampler(len(train), global_batch_size, seed, dp_rank, dp_size)
    inputs, targets = train.get_batch(sampler.next_batch())         # (B, T) int64 each
"""

from polytrain.data.cache import default_cache_dir, prepare_corpus, prepare_to
from polytrain.data.corpus import Corpus, Document, open_corpus
from polytrain.data.packed import PreparedCorpus, TokenDataset, load_prepared, prepare
from polytrain.data.sampler import GlobalBatchSampler, val_batches
from polytrain.data.split import Split, plan_split
from polytrain.data.tokenizer import EOT, Tokenizer, train_bpe

__all__ = [
    "EOT", "Corpus", "Document", "GlobalBatchSampler", "PreparedCorpus", "Split", "TokenDataset",
    "Tokenizer", "default_cache_dir", "load_prepared", "open_corpus", "plan_split", "prepare",
    "prepare_corpus", "prepare_to", "train_bpe", "val_batches",
]
