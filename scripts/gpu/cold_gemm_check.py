"""Does a GEMM give the same bits the first time it runs in autograd's backward thread as later? A tied head's
backward (bf16 logits tile, then fp32-output GEMMs for the hidden and weight gradients) in a fresh process, each
GEMM run in the main thread first (the reference), then in three backward passes of a custom autograd.Function."""
import torch

torch.manual_seed(0)
h = (torch.randn(1024, 128, device="cuda") * 0.5).to(torch.bfloat16)
w = (torch.randn(8192, 128, device="cuda") * 0.05).to(torch.bfloat16)
tile = torch.randn(1024, 8192, device="cuda").to(torch.bfloat16)


def gemms():
    return {"h @ w.T (bf16)": torch.mm(h, w.t()),
            "tile @ w (fp32 out)": torch.mm(tile, w, out_dtype=torch.float32),
            "tile.T @ h (fp32 out)": torch.mm(tile.t(), h, out_dtype=torch.float32)}


seen = []


class Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        seen.append(gemms())
        return g


if __name__ == "__main__":
    for i in range(3):
        x = torch.zeros(1, device="cuda", requires_grad=True)
        Probe.apply(x).sum().backward()
    ref = gemms()   # the main thread, after
    for i, got in enumerate(seen):
        print(f"backward {i + 1}: " + ", ".join(f"{k} {'same' if torch.equal(v, ref[k]) else 'DIFFERS'}"
                                               for k, v in got.items()), flush=True)
