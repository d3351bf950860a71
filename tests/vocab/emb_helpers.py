import torch

from ds_maximus.config import EmbeddingConfig


def make_config(cache_rows=16, lr=None, wd=None, mode="exact", opt="adamw", policy="lru", **kw):
    return EmbeddingConfig(gpu_cache_rows=cache_rows, cache_policy=policy,
                           optimizer={"type": opt, "mode": mode, "lr": lr, "weight_decay": wd}, **kw)


def zipf_batch(gen, vocab, tokens, s=1.1):
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    p = ranks.pow(-s)
    return torch.multinomial(p / p.sum(), tokens, replacement=True, generator=gen)


def train_pair(emb, dense, opt, batches, lrs, wd, micro=1):
    """Run the same batches through ShardedEmbedding (sparse_step) and nn.Embedding (+ ``opt``)."""
    for ids, lr in zip(batches, lrs):
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad()
        for mb in ids.chunk(micro):
            w = torch.randn(*mb.shape, dense.embedding_dim, generator=torch.Generator().manual_seed(int(mb.sum())))
            (dense(mb) * w).sum().backward()
            (emb(mb) * w).sum().backward()
        opt.step()
        emb.sparse_step(lr=lr, weight_decay=wd)
