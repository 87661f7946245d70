"""An ordinary training script that knows nothing of adaptive_eager.

    ADAPTIVE_EAGER=1 python examples/train.py && adaptive-eager report --last

Its last batches are smaller (a partial epoch end), which the report shows as a miss.
"""

import torch

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.LayerNorm(512), torch.nn.Linear(512, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True)
data = torch.randn(64 * 40 + 48 * 2, 256)
labels = torch.randint(0, 10, (data.shape[0],))

for epoch in range(2):
    for start in range(0, 64 * 40 + 48 * 2, 64):
        x, y = data[start:start + 64], labels[start:start + 64]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    print(f"epoch {epoch}: loss {loss.item():.4f}")
