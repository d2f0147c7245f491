"""torch.cuda's API, CUDA device names and amp, mapped onto the CPU by the shim."""

import time
import warnings

import pytest
import torch


def test_is_available_policy_and_device_selection(shim):
    assert torch.cuda.is_available() and torch.cuda.is_initialized()
    assert torch.cuda.device_count() == 2  # one per local rank
    torch.cuda.set_device(1)
    assert torch.cuda.current_device() == 1
    torch.cuda.set_device("cuda:0")
    assert torch.cuda.current_device() == 0
    with torch.cuda.device(torch.device("cuda", 1)):
        assert torch.cuda.current_device() == 1
    assert torch.cuda.current_device() == 0
    assert torch.cuda._get_device_index("cuda:1") == 1


def test_cuda_device_names_create_tensors_on_the_accelerator(shim):
    cpu = torch.device("cpu")
    made = [
        torch.zeros(2, device="cuda"), torch.ones(2, device="cuda:1"),
        torch.empty(2, device=torch.device("cuda")), torch.arange(3, device=0),
        torch.randn(2, device=torch.cuda.current_device()), torch.tensor([1.0], device="cuda"),
        torch.full((2,), 3.0, device="cuda"), torch.zeros_like(torch.ones(2), device="cuda"),
        torch.ones(2).new_zeros(3, device="cuda"), torch.nn.Linear(2, 2, device="cuda").weight,
    ]
    assert all(t.device == cpu for t in made)
    x = torch.ones(2)
    assert x.cuda().device == cpu and x.cuda(1).device == cpu
    assert x.to(0).device == cpu and x.to("cuda:1", torch.float16).dtype == torch.float16
    assert x.to(device=torch.device("cuda")).device == cpu
    assert x.to(torch.float64).dtype == torch.float64  # a dtype is not a device
    module = torch.nn.Linear(2, 2).cuda()
    assert module.weight.device == cpu and module.to("cuda:0") is module
    assert not x.is_cuda and x.device.type == "cpu"  # a tensor's own device is the truth


def test_legacy_type_names_read_as_cuda_ones(shim):
    # Megatron's mixed-precision optimizers keep the parameters whose type() is
    # "torch.cuda.BFloat16Tensor" / "torch.cuda.HalfTensor" in 16 bits and refuse any other name.
    assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(2).type() == "torch.cuda.FloatTensor"
    assert torch.nn.Linear(2, 2).weight.type() == "torch.cuda.FloatTensor"
    half = torch.ones(2).type("torch.cuda.HalfTensor")  # and the names cast, as before
    assert half.dtype == torch.float16 and half.type() == "torch.cuda.HalfTensor"
    assert torch.ones(2).type(torch.float64).dtype == torch.float64
    assert torch.ones(2, device="meta").type() == "torch.meta.FloatTensor"  # not on the accelerator


def test_device_contexts_meta_and_cuda(shim):
    with torch.device("meta"):  # e.g. polytrain's own meta-device build of big models
        assert torch.nn.Linear(4096, 4096).weight.device.type == "meta"
        assert torch.zeros(2).device.type == "meta"
    with torch.device("cuda:1"):
        assert torch.zeros(2).device.type == "cpu"


def test_pinning_is_a_no_op_without_a_device_to_copy_to(shim):
    x = torch.ones(4)
    assert x.pin_memory() is x and not x.is_pinned()
    assert torch.equal(x.pin_memory().to("cuda", non_blocking=True), x)
    data = torch.utils.data.TensorDataset(torch.arange(6.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns "no accelerator" for pin_memory=True
        batches = list(torch.utils.data.DataLoader(data, batch_size=3, pin_memory=True,
                                                   pin_memory_device="cuda"))
    assert torch.equal(batches[1][0], torch.tensor([3.0, 4.0, 5.0]))


def test_map_location_and_checkpoints_saved_on_a_gpu(shim, tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    # Write the file as a GPU would: storages tagged 'cuda:0'.
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save({"w": torch.arange(4.0)}, path)
    for location in (None, "cuda", "cuda:1", torch.device("cuda", 0), {"cuda:0": "cuda:1"}):
        loaded = torch.load(path, map_location=location)
        assert torch.equal(loaded["w"], torch.arange(4.0)) and loaded["w"].device.type == "cpu"


def test_events_time_and_streams_run_in_order(shim):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    time.sleep(0.02)
    end.record()
    torch.cuda.synchronize()
    assert 15 <= start.elapsed_time(end) < 500
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert torch.cuda.current_stream() is side
        y = torch.ones(3, device="cuda") * 2
        y.record_stream(side)
    torch.cuda.current_stream().wait_stream(side)
    side.synchronize()
    assert torch.cuda.current_stream() is torch.cuda.default_stream()
    assert torch.equal(y, torch.full((3,), 2.0))


def test_memory_statistics_are_the_processes_memory(shim):
    before = torch.cuda.memory_allocated()
    big = torch.ones(40_000_000, device="cuda")  # 160 MB
    assert torch.cuda.memory_allocated() - before > 100 * 2**20
    current = torch.cuda.memory_allocated()  # read first: the process may grow between the calls
    assert torch.cuda.max_memory_allocated() >= current > 0
    assert torch.cuda.memory_reserved() > 0
    assert torch.cuda.memory_stats()["allocated_bytes.all.peak"] > 0
    free, total = torch.cuda.mem_get_info()
    assert 0 < free <= total == torch.cuda.get_device_properties(0).total_memory
    del big
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    assert "resident" in torch.cuda.memory_summary()


def test_rng_functions_drive_the_generator_ops_use(shim):
    torch.cuda.manual_seed(11)
    state = torch.cuda.get_rng_state()
    first = torch.randn(3, device="cuda")
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.randn(3, device="cuda"), first)
    torch.cuda.manual_seed_all(11)
    assert torch.equal(torch.randn(3), first)
    states = torch.cuda.get_rng_state_all()
    assert len(states) == torch.cuda.device_count()
    torch.cuda.set_rng_state_all(states)
    # Megatron's RNG tracker: a state set through the default generator, possibly lazily.
    torch.cuda._lazy_call(lambda: torch.cuda.default_generators[1].set_state(state))
    assert torch.equal(torch.randn(3), first)
    with torch.random.fork_rng(devices=[0], device_type="cuda"):
        torch.randn(5)
    assert torch.cuda.initial_seed() == 11


def test_device_properties_describe_the_host(shim):
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    assert props.total_memory > 2**28 and props.multi_processor_count >= 1
    assert torch.cuda.get_device_capability() == (0, 0)  # no CUDA architecture
    assert torch.cuda.get_device_name(0) == props.name
    assert torch.cuda.is_bf16_supported() and torch.cuda.is_bf16_supported(including_emulation=False)


def test_autocast_keeps_cudas_default_dtype(shim):
    a = torch.randn(4, 4, device="cuda")
    with torch.autocast("cuda"):  # CUDA's default is fp16 where the CPU's is bf16
        assert (a @ a).dtype == torch.float16
        assert torch.is_autocast_enabled() and torch.is_autocast_enabled("cuda")
        assert torch.get_autocast_dtype("cuda") == torch.float16
    with torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16
    with torch.cuda.amp.autocast():
        assert (a @ a).dtype == torch.float16
    with torch.autocast("cuda", enabled=False):
        assert (a @ a).dtype == torch.float32


class _Square(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(ctx, x):
        assert x.dtype == torch.float32  # cast in, autocast off inside
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


def test_grad_scaler_and_custom_autograd_functions_run_a_scaled_step(shim):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    for scaler in (torch.cuda.amp.GradScaler(init_scale=1024.0), torch.amp.GradScaler()):
        assert scaler.is_enabled() and scaler._device == "cpu"
        with torch.autocast("cuda"):
            loss = _Square.apply(model(torch.randn(16, 8, device="cuda"))).mean()
        scaler.scale(loss).backward()
        assert model.weight.grad.abs().sum() > 0
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert scaler.get_scale() > 0 and not torch.equal(model.weight, before)


def test_nvtx_ranges_become_profiler_ranges(shim):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert torch.cuda.nvtx.range_push("outer") == 0
        assert torch.cuda.nvtx.range_push("inner") == 1
        torch.ones(2) + 1
        assert torch.cuda.nvtx.range_pop() == 1
        assert torch.cuda.nvtx.range_pop() == 0
        with torch.cuda.nvtx.range("step {}", 3):
            torch.ones(2) * 2
    names = {e.name for e in prof.events()}
    assert {"outer", "inner", "step 3"} <= names
    assert torch.cuda.nvtx.range_pop() == -1  # nothing open, as NVTX answers


@pytest.mark.parametrize("preset", [None, "cuda"])
def test_deepspeed_is_pointed_at_its_own_cpu_support(preset, monkeypatch):
    import os

    from polytrain.backend import CPUAccelerator
    from polytrain.backend.compat import install, uninstall

    if preset:
        monkeypatch.setenv("DS_ACCELERATOR", preset)
    else:
        monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    install(CPUAccelerator())
    try:
        assert os.environ["DS_ACCELERATOR"] == (preset or "cpu")  # a user's choice stands
    finally:
        uninstall()
    assert os.environ.get("DS_ACCELERATOR") == preset
