"""Which rows a tied head ends with differently from a run with a host wait after every step (the reference),
for ``reuse_rows`` on and off, in a fixed order in one process (the first run is the process's cold one), and
whether the gradient the step reads already differs (``grad``: the accumulated gradient copied before each step)
or only the step's result (test_gpu_tied_head_reading_its_step_rows_trains_bit_identically)."""
import torch

from ds_maximus.config import EmbeddingConfig
from ds_maximus.vocab import ShardedEmbedding
from ds_maximus.vocab.lm_head import ShardedLMHead

V, D = 40000, 128


def run(reuse, steps, sync, grab=False, dev="cuda"):
    g = torch.Generator().manual_seed(7)
    w0 = torch.randn(V, D, generator=g) * 0.05
    data = [(torch.randint(0, V, (4, 256), generator=g).to(dev), torch.randint(0, V, (4, 256), generator=g).to(dev))
            for _ in range(4)][:steps]
    emb = ShardedEmbedding(V, D, config=EmbeddingConfig(gpu_cache_rows=2048), _weight=w0, device=dev,
                           dtype=torch.bfloat16)
    head = ShardedLMHead(tied_to=emb, config={"chunk_rows": 8192, "reuse_rows": reuse})
    losses, grads = [], []
    for ids, y in data:
        loss = head(torch.tanh(emb(ids)), y)
        loss.backward()
        losses.append(loss.detach())
        if grab or sync:
            grads.append((emb.grad.ids.clone(), emb.grad.rows.detach().cpu()))
        emb.sparse_step(lr=1e-2)
        if sync:
            torch.cuda.synchronize()
    return {"losses": torch.stack(losses).cpu(), "w": emb.full_weight(), "data": data, "grads": grads,
            "name": f"reuse={reuse} steps={steps} sync={sync} grab={grab}"}


def compare(a, ref):
    wa, wb = a["w"], ref["w"]
    rows = (wa != wb).any(1).nonzero().flatten()
    ids = torch.zeros(V, dtype=torch.bool)
    tgt = torch.zeros(V, dtype=torch.bool)
    for i, y in a["data"]:
        ids[i.flatten().cpu()] = True
        tgt[y.flatten().cpu()] = True
    line = (f"{a['name']} vs reference: losses equal {torch.equal(a['losses'], ref['losses'])}, rows differing "
            f"{rows.numel()}, max |diff| {(wa - wb).abs().max().item():.3g}, of them lookup ids {int(ids[rows].sum())}"
            f", targets {int(tgt[rows].sum())}; first {rows[:6].tolist()}")
    for k, ((ia, ga), (ib, gb)) in enumerate(zip(a["grads"], ref["grads"])):
        same = torch.equal(ia, ib) and ga.shape == gb.shape
        gd = (ga != gb).any(1).nonzero().flatten() if same else None
        line += (f"\n    step {k + 1} gradient: " + ("ids differ" if not same else
                 f"rows differing {gd.numel()}, max |diff| {(ga - gb).abs().max().item():.3g}, max |g| of those "
                 f"{gb[gd].abs().max().item() if gd.numel() else 0:.3g}, in the head's last rows {gd[-3:].tolist()}"))
    print(line, flush=True)


if __name__ == "__main__":
    import sys
    first = sys.argv[1] if len(sys.argv) > 1 else "off"   # the reuse of the process's first (cold) run
    second = "on" if first == "off" else "off"
    order = [(first, 1, False, False), (second, 1, False, False), (first, 1, False, False), (second, 1, False, False),
             ("on", 4, False, False), ("off", 4, False, False), ("on", 4, False, True), ("off", 4, False, True),
             ("on", 1, False, True), ("off", 1, False, True)]
    runs = [run(*o) for o in order]
    refs = {s: run("off", s, True) for s in (1, 4)}
    for s in (1, 4):
        compare(run("on", s, True), refs[s])
    for r, o in zip(runs, order):
        compare(r, refs[o[1]])
