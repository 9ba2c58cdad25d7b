#!/usr/bin/python3
"""Demo helper: generates a small ImageFolder dataset, or trains a tiny model on one.

--generate DIR   writes 10 classes x 200 random 64x64 JPEGs (skipped if already there)
--train DIR      one epoch of a DataLoader (2 workers, batch 64, shuffle) over DIR, printing
                 samples/s and the cache hit rate read from --metrics (--hook: import cube_torch)
"""
import argparse
import os
import re
import sys
import time
import urllib.request

CLASSES = 10
PER_CLASS = 200


def generate(root: str) -> None:
    import numpy as np
    from PIL import Image

    marker = os.path.join(root, ".complete")
    if os.path.exists(marker):
        return
    rng = np.random.default_rng(0)
    total = CLASSES * PER_CLASS
    for c in range(CLASSES):
        d = os.path.join(root, f"class_{c:02d}")
        os.makedirs(d, exist_ok=True)
        for i in range(PER_CLASS):
            pixels = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(os.path.join(d, f"img_{i:04d}.jpg"), quality=90)
        done = (c + 1) * PER_CLASS
        print(f"\rgenerating dataset: {done}/{total} images", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    open(marker, "w").close()


def read_counters(url: str) -> dict:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for m in re.finditer(r'^cubetorchfs_reads_total\{result="(\w+)"\} ([0-9.e+]+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def train(root: str, metrics_url: str, label: str, hook: bool) -> None:
    if hook:
        import cube_torch  # noqa: F401  (publishes the DataLoader's upcoming files)
    import torch
    import torchvision
    from torchvision import transforms

    torch.manual_seed(0)
    ds = torchvision.datasets.ImageFolder(root, transform=transforms.ToTensor())
    loader = torch.utils.data.DataLoader(ds, batch_size=64, shuffle=True, num_workers=2)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(8, CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = torch.nn.CrossEntropyLoss()
    before = read_counters(metrics_url)
    for epoch in range(1):
        start = time.time()
        seen = 0
        for images, labels in loader:
            opt.zero_grad()
            loss = loss_fn(model(images), labels)
            loss.backward()
            opt.step()
            seen += len(labels)
        elapsed = time.time() - start
        after = read_counters(metrics_url)
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("hit", "late", "miss")}
        reads = sum(delta.values())
        if reads:
            cache = (f"daemon reads {reads:.0f}: hit {delta['hit']:.0f}, late {delta['late']:.0f}, "
                     f"miss {delta['miss']:.0f}, hit rate {delta['hit'] / reads:.3f}")
        else:
            cache = "every read served by the kernel page cache (no daemon reads)"
        print(f"{label}: {seen} samples in {elapsed:.2f} s = {seen / elapsed:.0f} samples/s; {cache}")
        before = after


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--generate", metavar="DIR")
    p.add_argument("--train", metavar="DIR")
    p.add_argument("--metrics", metavar="URL")
    p.add_argument("--label", default="epoch")
    p.add_argument("--hook", action="store_true")
    args = p.parse_args()
    if args.generate:
        generate(args.generate)
    if args.train:
        train(args.train, args.metrics, args.label, args.hook)


if __name__ == "__main__":
    main()
