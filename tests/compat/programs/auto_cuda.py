import torch

import polytrain.compat.auto  # noqa: F401  (the one line added to a CUDA script)

t = torch.ones(3, device="cuda:0").cuda()
torch.cuda.synchronize()
print(f"auto {t.device} {torch.cuda.is_available()}")
