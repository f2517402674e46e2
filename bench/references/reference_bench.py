#!/usr/bin/python3
"""Times the reference implementations mrr is measured against, on the CPU, with the shapes of
mrr's C++ benchmarks: PyTorch (Debian's python3-torch), Megatron-Core's moe_utils and verl's
core_algos, run as they are. The C++ benchmarks (bench_routing, bench_ppo) call this script and
print its times beside their own, so both come from one run.

The reference sources are not part of mrr. This script needs a few files of each, at the pinned
commits below, in a work directory (default: a temporary directory; the benchmarks pass their
build directory). It takes them, in this order:
  1. from a source you name: --megatron / --verl (or $MRR_MEGATRON_SRC / $MRR_VERL_SRC), either a
     git repository (a clone or a bare mirror holding the pinned commit: `git archive` extracts
     the files at that commit) or a plain directory tree (used as is; its commit is not checked);
  2. else downloaded at the pinned commits from the public repositories
     (raw.githubusercontent.com, or a mirror of its layout named by $MRR_REFERENCE_RAW_URL; cached
     in the work directory).
Without either, it stops with a message naming what is missing and both ways to provide it. Their heavy imports
(Transformer Engine, Megatron's parallel state, omegaconf, tensordict, transformers, ...) are
*stubbed* here: only the import statements are satisfied, and the functions timed below never
call into a stub on the paths used (fused=False, no Transformer Engine, batch-invariant mode off).

Output: one line per case, `REF <case> <microseconds>`, medians of repeated calls after warm-up
(the ppo suite: minima, as bench_ppo reports its own times) in steady state (freed memory kept,
see below, so outputs reuse their pages as in training).

It prints the BLAS library PyTorch's matrix products actually load (read from the process's
mapped libraries after a GEMM: Debian's python3-torch uses whichever libblas.so.3 the alternatives
system selects, the reference BLAS unless OpenBLAS is installed), PyTorch's build configuration
and OpenBLAS's kernel set. Where OpenBLAS runs kernels without AVX-512 on a CPU that has it
(OPENBLAS_CORETYPE=Haswell in the environment, or a detection older than the CPU), it reruns the
references without that setting, then with OPENBLAS_CORETYPE=SkylakeX, so that mrr is measured
against the fastest reference the machine can run: on an AMD Zen 5 the AVX2 kernels run a GEMM at
half the AVX-512 rate (104 against 204 GFLOP/s on one thread). --blas-core as-is keeps the
environment's or OpenBLAS's choice; the REFINFO line says which kernels ran and why.

PyTorch on the CPU has no caching allocator: every op's output is a fresh allocation, and glibc
serves large ones with a new mmap (and returns freed heap tops to the system), so each op pays
page faults for its output. On some VMs a page fault costs far more than on bare metal, and more
at some times than at others: verl's low_var_kl at B = 512, L = 4096 took 1.2-1.3 ms with freed
memory kept and 65-67 ms without, in the same minutes (the nineteenth session's AMD VM). mrr's
benchmarks reuse their outputs, as a training loop does; so that the references are measured in
the same steady state (as a caching allocator, jemalloc or tcmalloc would give them), this script
reruns itself with glibc keeping freed memory (MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_=2^40).
--allocator as-is keeps glibc's defaults; the REFINFO line says which ran.

Usage: reference_bench.py --suite routing|permute|ppo|moe|all [--threads N] [--workdir DIR]
                          [--megatron PATH] [--verl PATH] [--blas-core best|as-is]
                          [--allocator keep|as-is]
A fresh machine needs only (Debian): apt-get install python3-torch libopenblas0-pthread
"""
import argparse
import importlib
import importlib.abc
import importlib.machinery
import os
import subprocess
import sys
import tarfile
import io
import time
import types

MEGATRON_REPO = "NVIDIA/Megatron-LM"
MEGATRON_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
MEGATRON_FILES = ["megatron/core/transformer/moe/moe_utils.py", "megatron/core/transformer/moe/router_replay.py"]
VERL_REPO = "verl-project/verl"
VERL_COMMIT = "1dda039b9c6311889a9c9a26040677e1254814f9"  # the golden vectors' verl
VERL_FILES = ["verl/trainer/ppo/core_algos.py", "verl/utils/torch_functional.py", "verl/utils/groupwise.py"]


def _is_git(path):
    return subprocess.run(["git", "--git-dir", path, "rev-parse", "--git-dir"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0


def _git_dir(path):
    """The git directory of a clone (path/.git) or a bare repository (path), else None."""
    for candidate in (os.path.join(path, ".git"), path):
        if os.path.exists(candidate) and _is_git(candidate):
            return candidate
    return None


# Where the pinned files are downloaded from: GitHub's raw file service, or a mirror with the same
# layout (<base>/<owner>/<repo>/<commit>/<path>) named by $MRR_REFERENCE_RAW_URL.
RAW_URL = os.environ.get("MRR_REFERENCE_RAW_URL", "https://raw.githubusercontent.com").rstrip("/")


def _download(repo, commit, paths, dest):
    import urllib.request
    for path in paths:
        url = f"{RAW_URL}/{repo}/{commit}/{path}"
        target = os.path.join(dest, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with urllib.request.urlopen(url, timeout=60) as response:
            data = response.read()
        with open(target, "wb") as out:
            out.write(data)


def extract(name, repo, commit, paths, source, dest):
    """The reference's `paths` at `commit` under `dest`, from `source` (a git repository or a
    directory tree) or, without one, downloaded from GitHub. Skipped when already there."""
    stamp = os.path.join(dest, ".commit-" + commit)
    if os.path.exists(stamp):
        return
    os.makedirs(dest, exist_ok=True)
    if source:
        git_dir = _git_dir(source)
        if git_dir:
            done = subprocess.run(["git", "--git-dir", git_dir, "archive", commit] + paths, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE)
            if done.returncode != 0:
                sys.exit(f"reference_bench: {source} (the {name} source) does not hold commit {commit}: "
                         f"{done.stderr.decode().strip()}; fetch it there (git fetch origin {commit}) or pass another "
                         f"source")
            with tarfile.open(fileobj=io.BytesIO(done.stdout)) as tar:
                tar.extractall(dest)
        else:
            missing = [p for p in paths if not os.path.isfile(os.path.join(source, p))]
            if missing:
                sys.exit(f"reference_bench: {source} (the {name} source) lacks {', '.join(missing)}; pass a "
                         f"checkout of https://github.com/{repo} at {commit}")
            for p in paths:
                os.makedirs(os.path.dirname(os.path.join(dest, p)), exist_ok=True)
                with open(os.path.join(source, p), "rb") as src, open(os.path.join(dest, p), "wb") as out:
                    out.write(src.read())
            print(f"REFINFO {name} from the directory {source} (its commit is not checked; pinned: {commit[:12]})",
                  flush=True)
    else:
        try:
            _download(repo, commit, paths, dest)
        except Exception as e:  # no network, a proxy, GitHub down: say what is missing and how to provide it
            sys.exit(f"reference_bench: could not download {name} ({', '.join(paths)}) at {commit} from "
                     f"{RAW_URL}/{repo}: {e}. Either allow the download, or pass a clone: git clone "
                     f"https://github.com/{repo} && reference_bench.py --{name} <that clone> (it must hold {commit})")
    open(stamp, "w").close()


def blas_in_use(torch):
    """The BLAS shared library this process has mapped after a matrix product (Linux), and
    PyTorch's own record of the BLAS it was built against."""
    a = torch.randn(64, 64)
    (a @ a).sum().item()
    libs = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.split() else ""
                base = os.path.basename(path)
                if any(k in base for k in ("blas", "mkl_", "lapack", "openblas")):
                    libs.add(os.path.realpath(path))
    except OSError:
        pass
    built = [x.strip() for x in torch.__config__.show().replace(",", "\n").splitlines() if "BLAS_INFO" in x]
    return ", ".join(sorted(libs)) or "unknown (no BLAS library mapped)", (built[0] if built else "BLAS_INFO unknown")


# ---- import stubs (imports only; nothing timed calls into them) --------------------------------

def _identity_decorator(*args, **kwargs):
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda f: f


class _Anything:
    """Stands for any stubbed name: a class to subclass or annotate with, never called on the timed paths."""

    def __init__(self, *a, **k):
        pass

    def __getattr__(self, name):
        return _Anything()

    def __call__(self, *a, **k):
        return _Anything()


# Names whose value matters: Transformer Engine absent, batch-invariant mode and graph capture off.
_STUB_VALUES = {
    "HAVE_TE": False,
    "is_batch_invariant_mode_enabled": lambda: False,
    "is_graph_capturing": lambda: False,
    "is_te_min_version": lambda *a, **k: False,
    "deprecated": _identity_decorator,
    "internal_api": _identity_decorator,
    "get_device_name": lambda: "cpu",
    "get_torch_device": lambda: __import__("torch").cpu,
}


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _STUB_VALUES.get(name, _Anything)
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves a stub for every module under the given prefixes that is not a real extracted file."""

    def __init__(self, prefixes, real_roots):
        self.prefixes, self.real_roots = prefixes, real_roots

    def find_spec(self, name, path=None, target=None):
        if not any(name == p or name.startswith(p + ".") for p in self.prefixes):
            return None
        rel = name.replace(".", "/")
        for root in self.real_roots:
            if os.path.exists(os.path.join(root, rel + ".py")):
                return None  # a real extracted module: the path finder loads it
            if os.path.isdir(os.path.join(root, rel)):  # a package holding real modules: namespace-like stub
                spec = importlib.machinery.ModuleSpec(name, self, is_package=True)
                spec.submodule_search_locations = [os.path.join(r, rel) for r in self.real_roots]
                return spec
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        if module.__spec__.submodule_search_locations is not None:
            module.__path__ = list(module.__spec__.submodule_search_locations)


def load_references(workdir, megatron_src, verl_src):
    mdir, vdir = os.path.join(workdir, "megatron"), os.path.join(workdir, "verl")
    extract("megatron", MEGATRON_REPO, MEGATRON_COMMIT, MEGATRON_FILES, megatron_src, mdir)
    extract("verl", VERL_REPO, VERL_COMMIT, VERL_FILES, verl_src, vdir)
    sys.path[:0] = [mdir, vdir]
    sys.meta_path.insert(0, _StubFinder(["megatron", "verl", "omegaconf", "tensordict", "transformers", "flash_attn",
                                         "torch_npu"], [mdir, vdir]))
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    # core_algos does `from verl.utils import as_torch_index, group_mean_std`; verl/utils/__init__.py
    # (stubbed: it imports half of verl) re-exports them from groupwise.py, which is extracted.
    groupwise = importlib.import_module("verl.utils.groupwise")
    utils = importlib.import_module("verl.utils")
    utils.as_torch_index, utils.group_mean_std = groupwise.as_torch_index, groupwise.group_mean_std
    core_algos = importlib.import_module("verl.trainer.ppo.core_algos")
    return moe_utils, core_algos


# ---- timing -----------------------------------------------------------------------------------

def time_us(fn, min_seconds=0.25, min_reps=5, stat="median"):
    """Median (default) or minimum ("min") of repeated calls, in microseconds."""
    fn()  # warm-up
    samples, start = [], time.perf_counter()
    while len(samples) < min_reps or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
        if len(samples) >= 10000:
            break
    samples.sort()
    return (samples[0] if stat == "min" else samples[len(samples) // 2]) * 1e6


def report(case, us):
    print(f"REF {case} {us:.3f}", flush=True)


def routing_suite(torch, mu):
    T, k = 4096, 8
    for E in (64, 128, 256):
        g = torch.Generator().manual_seed(E)
        logits = torch.randn(T, E, generator=g)
        with torch.no_grad():
            # Qwen3 gate in Megatron: top-k on logits, softmax over the k (moe_router_pre_softmax=False).
            route = lambda: mu.topk_routing_with_score_function(logits, k, use_pre_softmax=False, score_function="softmax",
                                                                 dense_output=True)
            report(f"route_softmax_E{E}", time_us(route))
            _, ids = route()
            replay = lambda: mu.topk_routing_with_score_function(logits, k, use_pre_softmax=False,
                                                                  score_function="softmax", dense_output=True,
                                                                  precomputed_indices=ids)
            report(f"replay_softmax_E{E}", time_us(replay))
            report(f"replay_softmax_dense_E{E}", time_us(lambda: mu.topk_routing_with_score_function(
                logits, k, use_pre_softmax=False, score_function="softmax", precomputed_indices=ids)))
            report(f"replay_torch_gather_E{E}", time_us(lambda: torch.softmax(torch.gather(logits, 1, ids), dim=-1)))
            if E == 256:
                bias = torch.randn(E, generator=g) * 0.01
                ds = lambda: mu.topk_routing_with_score_function(logits, k, use_pre_softmax=False, num_groups=8,
                                                                  group_topk=4, scaling_factor=2.5,
                                                                  score_function="sigmoid", expert_bias=bias,
                                                                  dense_output=True)
                report(f"route_deepseek_E{E}", time_us(ds))


def permute_suite(torch, mu):
    T, H, k, E = 4096, 1024, 8, 64
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(T, E, generator=g)
    tokens = torch.randn(T, H, generator=g)
    with torch.no_grad():
        probs, routing_map = mu.topk_routing_with_score_function(logits, k, score_function="softmax")
        perm = lambda: mu.permute(tokens, routing_map, probs=probs, num_out_tokens=T * k)
        report(f"permute_T{T}_H{H}_k{k}", time_us(perm))
        permuted, permuted_probs, sorted_indices, _, _ = perm()
        report(f"unpermute_T{T}_H{H}_k{k}", time_us(lambda: mu.unpermute(permuted, sorted_indices, tokens.shape,
                                                                           probs=probs, routing_map=routing_map)))


class _ActorConfig(dict):
    """The attributes compute_policy_loss_vanilla reads from verl's ActorConfig (defaults)."""

    def __init__(self):
        super().__init__(clip_ratio_c=3.0)
        self.clip_ratio, self.clip_ratio_low, self.clip_ratio_high = 0.2, 0.2, 0.28
        self.global_batch_info = {}


class _AlgoConfig(dict):
    """What the outcome estimators read from verl's AlgoConfig: gamma (an attribute, default 1.0)
    and norm_adv_by_std_in_grpo (through get, default True)."""

    def __init__(self):
        super().__init__(norm_adv_by_std_in_grpo=True)
        self.gamma = 1.0


def ppo_suite(torch, ca):
    """verl's core_algos on the shapes of bench_ppo. Minimum of repeated calls (as bench_ppo
    reports for mrr): on a shared machine the minimum is the figure least disturbed by others."""
    import numpy as np
    import functools
    time_min = functools.partial(time_us, stat="min")

    def batch(B, L, seed):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(L // 4, L + 1, (B,), generator=g)
        mask = (torch.arange(L).unsqueeze(0) < lengths.unsqueeze(1)).float()
        return g, mask, lengths

    with torch.no_grad():
        B, L = 512, 4096
        g, mask, lengths = batch(B, L, 42)
        rewards, values = 0.01 * torch.randn(B, L, generator=g), torch.randn(B, L, generator=g)
        report(f"gae_B{B}_L{L}", time_min(lambda: ca.compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95),
                                          min_seconds=1.0, min_reps=3))
        for B, L in ((4096, 1024), (512, 4096)):
            g, mask, lengths = batch(B, L, 43)
            outcome = torch.zeros(B, L)
            outcome[torch.arange(B), lengths - 1] = torch.randint(0, 2, (B,), generator=g).float()
            index = np.array([1000 + i // 8 for i in range(B)])
            report(f"grpo_B{B}_L{L}", time_min(lambda: ca.compute_grpo_outcome_advantage(outcome, mask, index)))
            report(f"grpo_vectorized_B{B}_L{L}",
                   time_min(lambda: ca.compute_grpo_vectorized_outcome_advantage(outcome, mask, index)))
        B, L = 512, 4096
        g, mask, lengths = batch(B, L, 45)
        outcome = torch.zeros(B, L)
        outcome[torch.arange(B), lengths - 1] = torch.randint(0, 2, (B,), generator=g).float()
        old = -3 * torch.rand(B, L, generator=g)
        pi = old.exp()
        spsq = pi * pi + (1 - pi * pi) * 0.5 * torch.rand(B, L, generator=g)
        index = np.array([1000 + i // 8 for i in range(B)])
        for name, fn in (("optimal_token_baseline", ca.compute_optimal_token_baseline_advantage),
                         ("tir_optimal_token_baseline", ca.compute_multi_turn_optimal_token_baseline_advantage)):
            report(f"{name}_B{B}_L{L}", time_min(lambda: fn(outcome, mask, index, old, spsq), min_seconds=1.0,
                                                 min_reps=3))
        report(f"gdpo_B{B}_L{L}", time_min(lambda: ca.compute_gdpo_outcome_advantage(outcome, mask, index)))
        # The other outcome estimators on the same batch: groups of 8, gamma 1 (AlgoConfig's default),
        # ReMax's greedy baselines random scores.
        config = _AlgoConfig()
        baselines = torch.rand(B, generator=g)
        report(f"reinforce_plus_plus_B{B}_L{L}", time_min(
            lambda: ca.compute_reinforce_plus_plus_outcome_advantage(outcome, mask, config=config), min_seconds=1.0,
            min_reps=3))
        report(f"reinforce_plus_plus_baseline_B{B}_L{L}", time_min(
            lambda: ca.compute_reinforce_plus_plus_baseline_outcome_advantage(outcome, mask, index, config=config)))
        report(f"remax_B{B}_L{L}", time_min(
            lambda: ca.compute_remax_outcome_advantage(outcome, baselines, mask, config=config)))
        for name in ("rloo", "rloo_vectorized", "opo", "gpg", "grpo_passk"):
            fn = getattr(ca, f"compute_{name}_outcome_advantage")
            report(f"{name}_B{B}_L{L}", time_min(lambda: fn(outcome, mask, index, config=config)))
        for B, L in ((512, 4096), (256, 1024)):
            g, mask, _ = batch(B, L, 44)
            logprob = -torch.rand(B, L, generator=g) * 3
            ref = logprob + 0.1 * torch.randn(B, L, generator=g)
            report(f"kl_low_var_kl_B{B}_L{L}", time_min(lambda: ca.kl_penalty(logprob, ref, "low_var_kl")))
            adv = torch.randn(B, L, generator=g)
            cfg = _ActorConfig()
            report(f"policy_vanilla_token_mean_B{B}_L{L}", time_min(
                lambda: ca.compute_policy_loss_vanilla(ref, logprob, adv, mask, "token-mean", cfg)))


# ---- the whole MoE block (suite moe; pure PyTorch, needs neither Megatron nor verl) -------------

def _route_torch(torch, logits, router, k, ids=None):
    """Gating weights [T, k] and expert ids [T, k] as the Hugging Face blocks compute them; with
    `ids` given, the weights at those ids (replayed routes, as Megatron's precomputed_indices)."""
    if router == "deepseek":  # DeepseekV3TopkRouter: sigmoid, bias for selection, 8 groups top-4, x2.5
        scores = logits.sigmoid()
        if ids is None:
            E = logits.shape[1]
            choice = scores.detach() + 0.0  # the bias is zero in this benchmark, as in a fresh model
            group = choice.view(-1, 8, E // 8).topk(2, dim=-1)[0].sum(-1)
            keep = torch.zeros_like(group).scatter_(1, group.topk(4, dim=-1)[1], 1)
            keep = keep.unsqueeze(-1).expand(-1, 8, E // 8).reshape(-1, E)
            ids = choice.masked_fill(keep == 0, 0.0).topk(k, dim=-1)[1]
        w = scores.gather(1, ids)
        return w / (w.sum(-1, keepdim=True) + 1e-20) * 2.5, ids
    probs = torch.softmax(logits, dim=1, dtype=torch.float)
    if ids is None:
        w, ids = torch.topk(probs, k, dim=-1)
    else:
        w = probs.gather(1, ids)
    if router == "softmax_norm":  # Qwen3 (norm_topk_prob), Mixtral (softmax over the top-k logits)
        w = w / w.sum(-1, keepdim=True)
    return w, ids


class _Experts:
    def __init__(self, torch, E, H, I, seed):
        g = torch.Generator().manual_seed(seed)
        self.w_gate = (torch.randn(E, I, H, generator=g) * 0.05).requires_grad_()
        self.w_up = (torch.randn(E, I, H, generator=g) * 0.05).requires_grad_()
        self.w_down = (torch.randn(E, H, I, generator=g) * 0.05).requires_grad_()
        self.gate = (torch.randn(E, H, generator=g) * 0.5).requires_grad_()

    def mlp(self, torch, e, x):
        F = torch.nn.functional
        return F.linear(F.silu(F.linear(x, self.w_gate[e])) * F.linear(x, self.w_up[e]), self.w_down[e])


def hf_block(torch, ex, x, router, k, ids=None):
    """Qwen2/Qwen3-MoE's SparseMoeBlock (transformers): gate, routing, a loop over the experts that
    were hit, each gathering its tokens and adding its weighted output back with index_add_."""
    E = ex.gate.shape[0]
    w, ids = _route_torch(torch, torch.nn.functional.linear(x, ex.gate), router, k, ids)
    w = w.to(x.dtype)
    out = torch.zeros_like(x)
    mask = torch.nn.functional.one_hot(ids, num_classes=E).permute(2, 1, 0)
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist():
        slot, tok = torch.where(mask[e])
        out.index_add_(0, tok, ex.mlp(torch, e, x[tok]) * w[tok, slot, None])
    return out


def grouped_block(torch, ex, x, router, k, ids=None):
    """Megatron-style grouped MLP on the CPU: the (token, slot) pairs sorted by expert (a stable
    sort: token order within an expert), one gather, one matmul chain per expert on its contiguous
    rows, then the weighted rows scattered back with one index_add_."""
    E = ex.gate.shape[0]
    w, ids = _route_torch(torch, torch.nn.functional.linear(x, ex.gate), router, k, ids)
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True)[1]
    tokens = order // k
    counts = torch.bincount(flat, minlength=E).tolist()
    rows = x.index_select(0, tokens)
    outs = [ex.mlp(torch, e, chunk) for e, chunk in enumerate(torch.split(rows, counts)) if counts[e] > 0]
    y = torch.cat(outs) * w.reshape(-1).index_select(0, order).to(x.dtype).unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, tokens, y)


def moe_suite(torch, shapes):
    """shapes: 'name,T,H,I,E,k,router;...' (router: softmax, softmax_norm or deepseek). Per shape
    and block: forward (autograd on, as in training), backward of a kept graph, forward +
    backward, with native routing and with replayed ids; and the GEMM throughput of one expert's
    matmul at the shape's mean rows per expert, the limit the C++ benchmark compares against."""
    for spec in shapes.split(";"):
        name, T, H, I, E, k, router = spec.split(",")
        T, H, I, E, k = int(T), int(H), int(I), int(E), int(k)
        ex = _Experts(torch, E, H, I, seed=E + H)
        g = torch.Generator().manual_seed(7)
        x = torch.randn(T, H, generator=g).requires_grad_()
        dy = torch.randn(T, H, generator=g)
        with torch.no_grad():
            _, ids = _route_torch(torch, torch.nn.functional.linear(x, ex.gate), router, k)
        for label, block in (("hf", hf_block), ("grouped", grouped_block)):
            for mode, given in (("native", None), ("replay", ids)):
                fwd = lambda: block(torch, ex, x, router, k, given)
                report(f"moe_{name}_{label}_{mode}_forward", time_us(fwd, min_seconds=1.0, min_reps=5))
                out = fwd()
                report(f"moe_{name}_{label}_{mode}_backward",
                       time_us(lambda: out.backward(dy, retain_graph=True), min_seconds=1.0, min_reps=5))
                report(f"moe_{name}_{label}_{mode}_step", time_us(lambda: fwd().backward(dy), min_seconds=1.0, min_reps=5))
        n = max(1, T * k // E)
        a, b = torch.randn(n, H, generator=g), torch.randn(I, H, generator=g)
        gemm = time_us(lambda: torch.mm(a, b.t()), min_seconds=0.5, min_reps=20, stat="min")
        report(f"moe_{name}_gemm_flops", 2.0 * n * H * I / (gemm * 1e-6) * 1e-6)  # MFLOP/s in the us column


AVX512_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl")
AVX512_CORES = ("skylakex", "cooperlake", "sapphirerapids", "zen4", "zen5")


def openblas_core(libs):
    """The kernel set OpenBLAS picked at load (openblas_get_corename), or None without OpenBLAS."""
    import ctypes
    for path in libs.split(", "):
        try:
            lib = ctypes.CDLL(path)
            lib.openblas_get_corename.restype = ctypes.c_char_p
            return lib.openblas_get_corename().decode()
        except (OSError, AttributeError):
            continue
    return None


def cpu_has_avx512():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return all(flag in flags for flag in AVX512_FLAGS)
    except OSError:
        pass
    return False


# glibc tunables for the references' steady state (see the module's docstring).
KEEP_FREED_MEMORY = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def allocator_note(choice):
    if choice == "keep":
        return "allocator glibc keeping freed memory (MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_=2^40; " \
               "--allocator as-is: glibc's defaults)"
    return "allocator glibc as the environment sets it (--allocator as-is)"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suite", default="all", choices=["routing", "permute", "ppo", "moe", "all"])
    parser.add_argument("--moe-shapes", default="qwen3,2048,256,128,64,8,softmax_norm",
                        help="suite moe: 'name,T,H,I,E,k,router;...' (router: softmax, softmax_norm, deepseek)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--megatron", default=os.environ.get("MRR_MEGATRON_SRC"),
                        help="a Megatron-LM git repository or directory tree (default: download at the pinned commit)")
    parser.add_argument("--verl", default=os.environ.get("MRR_VERL_SRC"),
                        help="a verl git repository or directory tree (default: download at the pinned commit)")
    parser.add_argument("--blas-core", default="best", choices=["best", "as-is"],
                        help="best (default): where OpenBLAS runs kernels without AVX-512 on a CPU that has it "
                             "(an OPENBLAS_CORETYPE=Haswell in the environment, or a detection older than the CPU), "
                             "rerun without that OPENBLAS_CORETYPE, then with SkylakeX's kernels: AVX2 kernels run "
                             "GEMMs at half the rate on AMD Zen 5. as-is: keep the environment's or OpenBLAS's choice")
    parser.add_argument("--allocator", default="keep", choices=["keep", "as-is"],
                        help="keep (default): rerun with glibc keeping freed memory (MALLOC_MMAP_MAX_=0, "
                             "MALLOC_TRIM_THRESHOLD_=2^40), so PyTorch's per-op outputs reuse pages as a caching "
                             "allocator's would instead of paying fresh page faults on every call; as-is: glibc's "
                             "defaults")
    args = parser.parse_args()
    # glibc reads its tunables at start-up: set them and rerun (once: the second start finds them).
    if args.allocator == "keep" and any(os.environ.get(k) != v for k, v in KEEP_FREED_MEMORY.items()):
        os.environ.update(KEEP_FREED_MEMORY)
        os.execv(sys.executable, [sys.executable] + sys.argv)
    import tempfile
    # Debian's torch is built against the generic BLAS interface (BLAS_INFO=generic), so
    # torch.set_num_threads does not reach OpenBLAS, whose pthread build would otherwise use every
    # core: its thread count is set here, before the library loads.
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import torch
    torch.set_num_threads(args.threads)
    workdir = args.workdir or tempfile.mkdtemp(prefix="mrr-references-")
    blas, built = blas_in_use(torch)
    core = openblas_core(blas)
    # A reference slowed by a kernel set older than the CPU would flatter mrr: where OpenBLAS runs
    # kernels without AVX-512 on a CPU that has it, rerun letting OpenBLAS detect the CPU (when
    # OPENBLAS_CORETYPE forced the choice), then with SkylakeX's kernels (when its detection is older
    # than the CPU).
    stage = os.environ.get("MRR_REFERENCE_BLAS_STAGE", "")
    if core and args.blas_core == "best" and cpu_has_avx512() and core.lower() not in AVX512_CORES and \
            stage != "skylakex":
        if not stage:
            forced = os.environ.get("OPENBLAS_CORETYPE")
            os.environ["MRR_REFERENCE_BLAS_FIRST"] = core + (f" (OPENBLAS_CORETYPE={forced})" if forced else "")
        if "OPENBLAS_CORETYPE" in os.environ and not stage:
            del os.environ["OPENBLAS_CORETYPE"]
            os.environ["MRR_REFERENCE_BLAS_STAGE"] = "detect"
        else:
            os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"
            os.environ["MRR_REFERENCE_BLAS_STAGE"] = "skylakex"
        os.execv(sys.executable, [sys.executable] + sys.argv)
    if "MRR_REFERENCE_BLAS_FIRST" in os.environ:
        how = (f"instead of {os.environ['MRR_REFERENCE_BLAS_FIRST']}, without AVX-512 on this AVX-512 CPU; "
               "--blas-core as-is keeps that")
    elif "OPENBLAS_CORETYPE" in os.environ:
        how = f"OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']} in the environment"
    else:
        how = "OpenBLAS's own choice"
    print(f"REFINFO blas {blas} ({built}), OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}"
          + (f", OpenBLAS kernels {core} ({how})" if core else ""), flush=True)
    print(f"REFINFO {allocator_note(args.allocator)}", flush=True)
    if args.suite == "moe":  # pure PyTorch: no reference sources needed
        print(f"REFINFO torch {torch.__version__} threads {torch.get_num_threads()}", flush=True)
        moe_suite(torch, args.moe_shapes)
        return
    mu, ca = load_references(workdir, args.megatron, args.verl)
    print(f"REFINFO torch {torch.__version__} threads {torch.get_num_threads()} megatron {MEGATRON_COMMIT[:12]} "
          f"verl {VERL_COMMIT[:12]}", flush=True)
    if args.suite in ("routing", "all"):
        routing_suite(torch, mu)
    if args.suite in ("permute", "all"):
        permute_suite(torch, mu)
    if args.suite in ("ppo", "all"):
        ppo_suite(torch, ca)


if __name__ == "__main__":
    main()
