"""kdtree-convert and kdtree_jax.load under concurrency, kills and faults: nothing lost, nothing half-written.

Two real processes for the lock; a SIGKILL at every stage of the finish (kdtree_converters.convert.FAULT_ENV)
followed by a rerun; an OSError injected into the final rename.
"""

import errno
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

import kdtree_jax as kj
from kdtree_converters import convert as conv
from kdtree_jax.checkpoint import CheckpointError, sibling

from hf_models import build_hf_model, save_hf_model

pytest.importorskip("transformers")


def quiet_convert(src, out, **kw):
    logged = []
    conv.convert(src, out, progress=False, log=logged.append, **kw)
    return logged


def run_cli(*args, env=None, wait=True):
    cmd = [sys.executable, "-m", "kdtree_converters.convert", *args]
    kw = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": {**os.environ, **(env or {})}}
    if not wait:
        return subprocess.Popen(cmd, **kw)
    return subprocess.run(cmd, check=False, timeout=300, **kw)


def leftovers(out: str) -> list[str]:
    """The hidden siblings a conversion to out may leave: its work directory, lock and the replaced checkpoint."""
    return [s for s in ("partial", "lock", "old") if os.path.lexists(sibling(out, s))]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(a saved tiny Hugging Face model, its float32 conversion: the 'old' checkpoint that --overwrite replaces)."""
    root = tmp_path_factory.mktemp("src")
    src = save_hf_model(build_hf_model("yarn"), str(root / "hf"))
    quiet_convert(src, str(root / "old"), dtype="float32")
    return src, str(root / "old")


# ---------------------------------------------------------------------------------------------------------------
# Concurrency and the crash-safe finish
# ---------------------------------------------------------------------------------------------------------------


def wait_stopped(pid: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.05)
    raise TimeoutError(f"process {pid} did not stop")


def test_second_conversion_fails_at_once_naming_the_first(source, tmp_path):
    src, _ = source
    out = str(tmp_path / "out")
    first = run_cli(src, out, env={conv.FAULT_ENV: "written:1=STOP"}, wait=False)  # stops holding the lock
    try:
        wait_stopped(first.pid)
        progress = sorted(os.listdir(os.path.join(sibling(out, "partial"), "params")))
        t0 = time.monotonic()
        second = run_cli(src, out)
        assert second.returncode == 1 and time.monotonic() - t0 < 60
        err = second.stderr.strip().splitlines()
        assert len(err) == 1 and f"another kdtree-convert (pid {first.pid}) is writing {out}" in err[0], err
        assert sorted(os.listdir(os.path.join(sibling(out, "partial"), "params"))) == progress  # untouched
        os.kill(first.pid, signal.SIGCONT)
        _, stderr = first.communicate(timeout=300)
        assert first.returncode == 0, stderr
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    m = kj.load(out, verify=True)
    assert m.cfg.dtype == "bfloat16" and leftovers(out) == []


def same_file_tree(a: str, b: str) -> bool:
    """Whether two checkpoints hold the same config and manifest (the converted arrays are checked by verify)."""
    return all(open(os.path.join(a, f)).read() == open(os.path.join(b, f)).read()
               for f in ("config.json", "manifest.json"))


# stage -> what OUT holds right after a kill there: the old checkpoint, or nothing (moved aside)
STAGES = {"written:4": "old", "manifest": "old", "sealed": "old", "aside": None, "landed": "new"}


@pytest.mark.parametrize("stage", list(STAGES))
def test_kill_at_each_stage_of_the_finish(source, tmp_path, stage):
    src, old = source
    out = str(tmp_path / "out")
    shutil.copytree(old, out)
    killed = run_cli(src, out, "--overwrite", env={conv.FAULT_ENV: f"{stage}=KILL"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    if STAGES[stage] is None:
        assert not os.path.exists(out)
        with pytest.raises(CheckpointError, match="rerun that command to finish it"):
            kj.load(out)
    else:
        assert kj.load(out, verify=True).cfg.dtype == {"old": "float32", "new": "bfloat16"}[STAGES[stage]]
    logged = quiet_convert(src, out, overwrite=True)  # the rerun
    complete = stage in ("manifest", "sealed", "aside")
    assert any(line.startswith("finishing") for line in logged) == complete, logged
    assert kj.load(out, verify=True).cfg.dtype == "bfloat16" and leftovers(out) == []


def test_kill_while_replacing_then_other_options_restores_the_old_checkpoint(source, tmp_path):
    """Killed with OUT moved aside and the new work unfinished: any later run puts the old checkpoint back first."""
    src, old = source
    out = str(tmp_path / "out")
    shutil.copytree(old, out)
    assert run_cli(src, out, "--overwrite", env={conv.FAULT_ENV: "aside=KILL"}).returncode == -signal.SIGKILL
    with pytest.raises(CheckpointError, match="already exists"):  # other options, no --overwrite
        quiet_convert(src, out, dtype="float32")
    assert same_file_tree(out, old) and leftovers(out) == ["partial"]  # the killed run's finished work is kept
    kj.load(out, verify=True)
    assert any(line.startswith("finishing") for line in quiet_convert(src, out, overwrite=True))  # and published
    assert kj.load(out, verify=True).cfg.dtype == "bfloat16" and leftovers(out) == []


def test_failed_final_rename_restores_the_old_checkpoint(source, tmp_path, monkeypatch):
    src, old = source
    out = str(tmp_path / "out")
    shutil.copytree(old, out)
    rename = os.rename

    def failing(a, b):
        if a == sibling(out, "partial"):
            raise OSError(errno.EIO, "Input/output error", a)
        return rename(a, b)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError, match="Input/output error"):
        quiet_convert(src, out, overwrite=True)
    monkeypatch.setattr(os, "rename", rename)
    assert same_file_tree(out, old) and leftovers(out) == ["partial"]
    assert any(line.startswith("finishing") for line in quiet_convert(src, out, overwrite=True))
    assert kj.load(out).cfg.dtype == "bfloat16" and leftovers(out) == []


def test_overwrite_through_a_symlink_replaces_its_target(source, tmp_path, capsys):
    src, old = source
    target, link = tmp_path / "target", tmp_path / "link"
    shutil.copytree(old, target)
    link.symlink_to(target)
    assert conv.main([src, str(link), "--overwrite"]) == 0, capsys.readouterr().err
    assert link.is_symlink() and kj.load(str(link)).cfg.dtype == "bfloat16"
    assert sorted(os.listdir(tmp_path)) == ["link", "target"]


def test_a_source_inside_the_checkpoint_it_would_replace_is_refused(source, tmp_path, capsys):
    """--overwrite replaces OUT_DIR whole: with SRC_DIR (or --drafter) inside it, the conversion succeeded and then
    deleted its own source. Now one line naming both, and nothing touched."""
    src, old = source
    out = tmp_path / "ckpt"
    shutil.copytree(old, out)
    inner = str(shutil.copytree(src, out / "hf"))
    before = sorted(os.listdir(out))
    assert conv.main([inner, str(out), "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"SRC_DIR {inner} is inside OUT_DIR {out}" in err, err
    with pytest.raises(CheckpointError, match="--drafter .* is inside OUT_DIR"):
        quiet_convert(src, str(out), overwrite=True, drafter=str(out / "hf"))
    assert sorted(os.listdir(out)) == before and os.path.isfile(out / "hf" / "config.json") and not leftovers(str(out))


def test_full_disk_is_one_line_and_the_rerun_resumes(source, tmp_path, monkeypatch, capsys):
    src, _ = source
    out = str(tmp_path / "out")
    save_item = conv.ckpt.save_item
    calls = []

    def full(*args):
        calls.append(args[-1])
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", args[0])
        return save_item(*args)

    monkeypatch.setattr(conv.ckpt, "save_item", full)
    assert conv.main([src, out]) == 1
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]  # after the progress bar
    assert "Traceback" not in err and line.startswith("kdtree-convert: error: [Errno 28] No space left on device")
    assert "rerun the same command to resume" in line
    assert leftovers(out) == ["partial"]
    monkeypatch.setattr(conv.ckpt, "save_item", save_item)
    assert conv.main([src, out]) == 0 and "resuming" in capsys.readouterr().err
    kj.load(out, verify=True)


# ---------------------------------------------------------------------------------------------------------------
# Relative paths, checksums, corrupt checkpoints
# ---------------------------------------------------------------------------------------------------------------


def test_relative_paths(source, tmp_path, monkeypatch, capsys):
    from kdtree_jax.cli import main as cli

    src, old = source
    shutil.copytree(src, tmp_path / "hf")
    monkeypatch.chdir(tmp_path)
    assert conv.main(["hf", "out", "--dtype", "float32"]) == 0
    assert kj.load("out").manifest["checksums"] == kj.load(old).manifest["checksums"]  # the same arrays
    capsys.readouterr()
    assert cli(["generate", "--model", "out", "--prompt", "ab", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("ab")


def flip_byte(item_dir: str) -> None:
    """Flip one byte in the middle of an item's largest data file (array values, not metadata)."""
    files = [os.path.join(r, f) for r, _, fs in os.walk(item_dir) for f in fs if os.sep + "d" + os.sep in
             os.path.join(r, f)]
    path = max(files, key=os.path.getsize)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def test_checksums_catch_flipped_bytes(source, tmp_path, capsys):
    _, old = source
    assert conv.main(["--verify", old]) == 0 and "all 46 arrays match" in capsys.readouterr().out
    bad = str(tmp_path / "bad")
    shutil.copytree(old, bad)
    flip_byte(os.path.join(bad, "params", "layer_001"))
    with pytest.raises(CheckpointError, match=r"layer_001: array '.*' does not match its checksum"):
        kj.load(bad)  # checked as it is read, by default
    kj.load(bad, verify=False)  # the opt-out: flipped bytes load as they are
    assert conv.main(["--verify", bad]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not match its checksum" in err[0]
    from kdtree_jax.cli import main as cli

    assert cli(["generate", "--model", bad, "--prompt", "x", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not match its checksum" in err[0]


def test_native_crc32_equals_zlib():
    """The checksums come from the C++ library's CRC-32 (carry-less-multiply folding) where it is built: equal to
    zlib's for every length 0..600 (the folding starts at 64 bytes), every start value kind, at odd addresses, and
    on a large array; it folds on a CPU with PCLMULQDQ (the x86 machines CI and the GPU hosts run on)."""
    import kdtree_jax.checkpoint as ckpt
    from kdtree_jax.kernels._registry import cpu_library

    assert ckpt._native_crc32() is not None, "the C++ library has no KdCrc32: checksums would fall back to zlib"
    with open("/proc/cpuinfo") as f:
        clmul = " pclmulqdq " in f.read().replace("\n", " ")
    assert cpu_library().KdCrc32Folds() == int(clmul)
    rng = np.random.default_rng(11)
    buf = rng.integers(0, 256, 700, dtype=np.uint8)
    for n in range(601):
        for off in (0, 1, 3):
            piece = buf[off:off + n]
            for start in (0, 1, 0xDEADBEEF, zlib.crc32(buf[:5])):
                assert ckpt.crc32_update(piece, start) == zlib.crc32(piece, start), (n, off, start)
    big = rng.integers(0, 256, (3 << 20) + 77, dtype=np.uint8)
    assert ckpt.crc32_update(big[1:]) == zlib.crc32(big[1:])
    assert ckpt.crc32(big.view(np.uint8)[:-1]) == f"{zlib.crc32(big[:-1]):08x}"


def test_checksums_in_pieces_equal_zlib_and_catch_a_flip_in_any_piece(source, tmp_path, monkeypatch):
    """Checked loads compute a large array's CRC-32 in pieces on worker threads and join them: the joined value is
    zlib's CRC-32 of the whole array for any size and piece length, and a flipped byte in a later piece of a
    multi-piece array is still a CheckpointError."""
    from concurrent.futures import ThreadPoolExecutor

    import kdtree_jax.checkpoint as ckpt

    rng = np.random.default_rng(5)
    with ThreadPoolExecutor(2) as pool:
        for n in (0, 1, 7, 4095, 4096, 4097, 3 * 4096 + 5, 100_003):
            a = rng.integers(0, 256, n, dtype=np.uint8)
            for piece in (1, 3, 4096, 1 << 20):
                assert ckpt.crc32_pieces(a, pool.submit, piece)() == f"{zlib.crc32(a):08x}", (n, piece)
        b = rng.standard_normal((300, 1001)).astype(np.float32)
        assert ckpt.crc32_pieces(b, pool.submit, 4096)() == ckpt.crc32(b)
    _, old = source
    bad = str(tmp_path / "bad")
    shutil.copytree(old, bad)
    flip_byte(os.path.join(bad, "params", "layer_001"))
    monkeypatch.setattr(ckpt, "CRC_PIECE", 1024)  # every array of the small model in several pieces
    with pytest.raises(CheckpointError, match=r"layer_001: array '.*' does not match its checksum"):
        kj.load(bad)
    assert kj.load(old).manifest["checksums"]  # the intact checkpoint loads, checked in pieces


@pytest.mark.parametrize("damage", ["truncated_data", "truncated_metadata"])
def test_corrupt_orbax_files_are_clear_errors(source, tmp_path, damage, capsys):
    from kdtree_jax.cli import main as cli

    _, old = source
    bad = str(tmp_path / "bad")
    shutil.copytree(old, bad)
    part = os.path.join(bad, "params", "layer_002", "part_000")
    if damage == "truncated_data":
        data = [os.path.join(part, "ocdbt.process_0", "d", f) for f in os.listdir(os.path.join(part, "ocdbt.process_0",
                                                                                             "d"))]
        os.truncate(max(data, key=os.path.getsize), 100)
    else:
        os.truncate(os.path.join(part, "_METADATA"), 10)
    with pytest.raises(CheckpointError, match="layer_002: .* is corrupt"):
        kj.load(bad)
    assert cli(["generate", "--model", bad, "--prompt", "x", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is corrupt" in err[0] and len(err[0]) < 1000


@pytest.mark.parametrize("text, message", [("[]", "expected a JSON object"),
                                           ('{"num_layers": 1}', "not a drafter config"),
                                           (json.dumps({"num_layers": 1, "block_size": "8", "hidden_size": 32,
                                                        "num_heads": 4, "num_kv_heads": 1, "head_dim": 8,
                                                        "intermediate_size": 64, "target_layer_ids": [0],
                                                        "mask_token_id": 1, "vocab_size": 264,
                                                        "target_num_layers": 2}),
                                            "not a drafter config \\(drafter config field 'block_size' must be an "
                                            "integer >= 1, got '8'\\)")])
def test_bogus_drafter_in_a_checkpoint_is_a_clear_error(source, tmp_path, text, message):
    bad = tmp_path / "bad"
    shutil.copytree(source[1], bad)
    (bad / "drafter").mkdir()
    (bad / "drafter" / "drafter_config.json").write_text(text)
    with pytest.raises(CheckpointError, match=message):
        kj.load(str(bad))


def damage_checkpoint(ckpt_dir, damage: str) -> None:
    """Break one thing kj.load reads, other than array bytes."""
    ckpt_dir = pathlib.Path(ckpt_dir)
    config = ckpt_dir / "config.json"
    if damage == "no_config":
        config.unlink()
    elif damage == "malformed_config":
        config.write_text('{"vocab_size": 264,\n')
    elif damage == "config_of_another_model":
        config.write_text(json.dumps({**json.loads(config.read_text()), "hidden_size": 96}))
    elif damage == "bogus_drafter":
        (ckpt_dir / "drafter").mkdir()
        (ckpt_dir / "drafter" / "drafter_config.json").write_text('{"num_layers": 1}')
    elif damage == "broken_tokenizer":
        (ckpt_dir / "tiktoken.model").write_text("not a tiktoken file\n")
    else:  # a tokenizer file the manifest lists is gone: load would fall back to bytes without a word
        manifest = json.loads((ckpt_dir / "manifest.json").read_text())
        (ckpt_dir / "manifest.json").write_text(json.dumps({**manifest, "tokenizer_files": ["tiktoken.model"]}))


@pytest.mark.parametrize("damage, message", [
    ("no_config", "config.json is missing"),
    ("malformed_config", "config.json: not valid JSON"),
    ("config_of_another_model", r"top \(against .*config.json\): array 'embed' has shape \(264, 64\)"),
    ("bogus_drafter", "not a drafter config"),
    ("broken_tokenizer", "tokenizer files of .* do not load: .*tiktoken.model:1: not a tiktoken BPE line"),
    ("listed_tokenizer_missing", "tokenizer file tiktoken.model is missing"),
])
def test_verify_checks_everything_load_reads(source, tmp_path, capsys, damage, message):
    """`kdtree-convert --verify` passes nothing that kj.load refuses (or loads differently): the config, the arrays'
    shapes against it, the drafter and the tokenizer files, besides every array's checksum."""
    bad = tmp_path / "bad"
    shutil.copytree(source[1], bad)
    damage_checkpoint(bad, damage)
    with pytest.raises((CheckpointError, OSError, ValueError)):  # a listed tokenizer file gone: load refuses too
        kj.load(str(bad))
    assert conv.main(["--verify", str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kdtree-convert: error: ") and re.search(message, err[0]), err


def _edit_manifest(ckpt_dir: str, edit) -> None:
    path = os.path.join(ckpt_dir, "manifest.json")
    manifest = json.load(open(path))
    edit(manifest)
    json.dump(manifest, open(path, "w"))


@pytest.mark.parametrize("damage, message", [
    (lambda d: _edit_manifest(d, lambda m: m["checksums"].pop("layer_001")),
     "layer_001: array '.*' is not in the manifest"),  # --verify passed it; load refused it
    (lambda d: _edit_manifest(d, lambda m: m.update(checksums=[1, 2])),
     r"manifest.json: \"checksums\" must map each item"),  # was AttributeError: 'list' object has no attribute 'get'
    (lambda d: _edit_manifest(d, lambda m: m["checksums"].update(top=["x"])),
     r"manifest.json: the checksums of 'top' must map each array"),
    (lambda d: _edit_manifest(d, lambda m: m.update(tokenizer_files=["../../../../etc/hostname"])),
     "tokenizer file '../../../../etc/hostname' is not inside the checkpoint"),  # --verify looked outside
    (lambda d: _edit_manifest(d, lambda m: m.update(tokenizer_files=[1])),
     r"\"tokenizer_files\" must be a list of file names, got \[1\]"),  # was a TypeError of os.path.join
    (lambda d: (os.remove(os.path.join(d, "config.json")), os.symlink("config.json", os.path.join(d, "config.json"))),
     "config.json does not open: Too many levels of symbolic links"),  # load: OSError; --verify: "is missing"
    (lambda d: (os.remove(os.path.join(d, "config.json")), os.mkdir(os.path.join(d, "config.json"))),
     "config.json is not a regular file"),  # --verify said "is missing"
], ids=["item_without_checksums", "checksums_a_list", "item_checksums_a_list", "tokenizer_file_outside",
        "tokenizer_file_not_a_name", "config_symlink_loop", "config_a_directory"])
def test_a_hostile_manifest_or_config_is_one_error_for_load_and_verify(source, tmp_path, capsys, damage, message):
    """Issue 46, fourth probe round: `kj.load` raises a CheckpointError and `--verify` prints one line, both naming
    the problem."""
    bad = str(tmp_path / "bad")
    shutil.copytree(source[1], bad)
    damage(bad)
    with pytest.raises(CheckpointError, match=message):
        kj.load(bad)
    assert conv.main(["--verify", bad]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kdtree-convert: error: ") and re.search(message, err[0]), err


# A real write failure inside orbax's threads: files past RLIMIT_FSIZE fail with EFBIG, as a full disk fails with
# ENOSPC (SIGXFSZ ignored, so that the write fails instead of killing the process).
FILE_SIZE_LIMIT = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]),) * 2)
from kdtree_converters.convert import main
sys.exit(main(sys.argv[2:]))
"""
PROGRESS = re.compile(r"^kdtree-convert[^:]*:\s+\d+%\|")  # tqdm's bar, redrawn on stderr


def test_a_write_failing_inside_orbax_is_one_line_and_the_rerun_resumes(source, tmp_path):
    src, _ = source
    out = str(tmp_path / "out")
    proc = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMIT, "60000", src, out], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in re.split(r"[\r\n]", proc.stderr) if line.strip() and not PROGRESS.match(line)]
    assert "Traceback" not in proc.stderr and "absl" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("kdtree-convert: error: ") and "File too large" in lines[0], lines
    assert "rerun the same command to resume" in lines[0] and leftovers(out) == ["partial"]
    # which item first outgrows the limit depends on how orbax batches its writes (it varies with the machine's
    # load): the rerun resumes from the items the first run recorded, when it recorded any
    progress = os.path.join(sibling(out, "partial"), "progress.json")
    recorded = json.load(open(progress)) if os.path.exists(progress) else {}
    rerun = run_cli(src, out)
    assert rerun.returncode == 0 and (f"resuming {sibling(out, 'partial')}: {len(recorded)} of" in rerun.stderr
                                      if recorded else "resuming" not in rerun.stderr), rerun.stderr
    assert leftovers(out) == []
    kj.load(out, verify=True)


LOAD = """
import sys
import kdtree_jax as kj
from kdtree_jax.checkpoint import CheckpointError
try:
    kj.load(sys.argv[1])
except CheckpointError as e:
    print(e)
"""


@pytest.mark.parametrize("damage", ["missing_data_file", "truncated_data_file", "zeroed_part"])
def test_a_broken_data_file_is_one_line_in_real_processes(source, tmp_path, damage):
    """The CLI prints one line and exits 2; the API raises CheckpointError and writes nothing on stderr (orbax's
    threads and tasks, which fail after the first error, stay quiet to the end of the process)."""
    bad = str(tmp_path / "bad")
    shutil.copytree(source[1], bad)
    d = os.path.join(bad, "params", "layer_001", "part_000", "ocdbt.process_0", "d")
    largest = max((os.path.join(d, f) for f in os.listdir(d)), key=os.path.getsize)
    if damage == "missing_data_file":
        os.remove(largest)
    elif damage == "truncated_data_file":
        os.truncate(largest, 100)
    else:  # every file of the part zeroed: orbax warned "Failed to get item metadata" on stderr, a second line
        for root, _, files in os.walk(os.path.join(bad, "params", "layer_001")):
            for f in files:
                with open(os.path.join(root, f), "r+b") as out:
                    out.write(bytes(os.path.getsize(os.path.join(root, f))))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    cli = subprocess.run([sys.executable, "-m", "kdtree_jax.cli", "generate", "--model", bad, "--prompt", "x",
                          "--max-new-tokens", "2"], capture_output=True, text=True, timeout=300, env=env)
    err = cli.stderr.strip().splitlines()
    assert cli.returncode == 2 and len(err) == 1, cli.stderr
    assert err[0].startswith("kdtree-jax: error: layer_001: ") and "is corrupt or truncated" in err[0]
    api = subprocess.run([sys.executable, "-c", LOAD, bad], capture_output=True, text=True, timeout=300, env=env)
    assert api.returncode == 0 and api.stderr == "" and "layer_001: " in api.stdout, api.stderr


# ---------------------------------------------------------------------------------------------------------------
# Bad sources and outputs: one line, exit status 1, nothing written (a traceback only with --debug)
# ---------------------------------------------------------------------------------------------------------------


def copy_source(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_fifo_source_is_refused_not_read(source, tmp_path):
    src = copy_source(source[0], tmp_path / "hf")
    os.remove(os.path.join(src, "model.safetensors"))
    os.mkfifo(os.path.join(src, "model.safetensors"))
    signal.alarm(60)  # a read of the FIFO would block forever
    try:
        with pytest.raises(CheckpointError, match="model.safetensors is not a regular file"):
            quiet_convert(src, str(tmp_path / "out"))
        os.rename(os.path.join(src, "model.safetensors"), os.path.join(src, "config.json"))
        with pytest.raises(CheckpointError, match="config.json is not a regular file"):
            quiet_convert(src, str(tmp_path / "out"))
    finally:
        signal.alarm(0)
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def write_config(src: str, text: str) -> None:
    with open(os.path.join(src, "config.json"), "w") as f:
        f.write(text)


@pytest.mark.parametrize("case, message", [
    ("malformed_config", "not valid JSON"),
    ("list_config", "expected a JSON object, found a JSON list"),
    ("config_value_types", "config field 'quantization_config' must be an object, got 'fp8'"),
    ("out_parent_is_a_file", "file is not a directory"),
    ("read_only", "Read-only file system"),
])
def test_failures_are_one_line(source, tmp_path, monkeypatch, capsys, case, message):
    src = copy_source(source[0], tmp_path / "hf")
    out = str(tmp_path / "out")
    if case == "malformed_config":
        write_config(src, '{"vocab_size": 264,')
    elif case == "list_config":
        write_config(src, "[1, 2]")
    elif case == "config_value_types":
        write_config(src, '{"quantization_config": "fp8"}')
    elif case == "out_parent_is_a_file":
        (tmp_path / "file").write_text("")
        out = str(tmp_path / "file" / "out")
    else:
        makedirs = os.makedirs

        def read_only(path, *args, **kw):
            if str(path).startswith(str(tmp_path)):
                raise OSError(errno.EROFS, "Read-only file system", path)
            return makedirs(path, *args, **kw)

        monkeypatch.setattr(os, "makedirs", read_only)
        out = str(tmp_path / "new" / "out")
    assert conv.main([src, out]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kdtree-convert: error: ") and message in err[0], err
    assert sorted(os.listdir(tmp_path)) == sorted(["hf"] + ["file"] * (case == "out_parent_is_a_file"))
    with pytest.raises(Exception, match=message):
        conv.main([src, out, "--debug"])


def test_verify_takes_no_other_arguments(capsys):
    with pytest.raises(SystemExit):
        conv.main(["a", "b", "--verify", "c"])
    assert "--verify CKPT takes no SRC_DIR" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# Hostile files: counts, types and paths that the files themselves set
# ---------------------------------------------------------------------------------------------------------------


def edit_json(path, **changes) -> None:
    path = pathlib.Path(path)
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


# Caps the address space at 4 GiB, then runs argv[1:] (in the child itself: a preexec_fn would fork the threaded
# test process)
CAPPED = "import os, resource, sys; resource.setrlimit(resource.RLIMIT_AS, (4 << 30,) * 2); os.execv(sys.argv[1], " \
         "sys.argv[1:])"


def limited(cmd: list[str], timeout: float = 60):
    """cmd in a subprocess on CPU JAX, its address space capped at 4 GiB (a runaway allocation fails instead of
    taking the machine's memory) and its time at `timeout` (a hang fails the test instead of stalling it)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    try:
        return subprocess.run([sys.executable, "-c", CAPPED, *cmd], capture_output=True, text=True, timeout=timeout,
                              env=env, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{cmd[1:4]} still ran after {timeout} s (a hang)")


def one_error_line(proc, prog: str, status: int) -> str:
    """The single `prog: error: ...` line a failing command prints (and nothing else, no traceback)."""
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == status and len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert err[0].startswith(f"{prog}: error: "), err
    return err[0]


CONVERT = [sys.executable, "-m", "kdtree_converters.convert"]
GENERATE = [sys.executable, "-m", "kdtree_jax.cli", "generate", "--prompt", "x", "--max-new-tokens", "2", "--model"]
# kj.load, kdtree-convert --verify and a conversion's dry run, timed inside one process (imports excluded)
TIMED = """
import sys, time
import kdtree_jax as kj
from kdtree_converters import convert as conv
from kdtree_jax.checkpoint import CheckpointError
from kdtree_jax.config import ConfigError
for name, call in (("load", lambda: kj.load(sys.argv[1])), ("verify", lambda: conv.verify(sys.argv[1])),
                   ("convert", lambda: conv.convert(sys.argv[2], sys.argv[3], dry_run=True, progress=False))):
    t0 = time.perf_counter()
    try:
        call()
        print(name, "returned")
    except (CheckpointError, ConfigError) as e:
        print(name, f"{time.perf_counter() - t0:.3f}", e)
"""


@pytest.mark.parametrize("command", ["verify", "generate", "convert"])
def test_a_config_of_a_billion_layers_fails_at_once(source, tmp_path, command):
    """num_hidden_layers edited to 10**9 in a checkpoint's (or a source's) config.json: one line naming the file
    and both counts, found by comparing with the manifest's items (the source's tensor names) before anything is
    built per layer. Before, each command built 10**9 layer structures: no end, memory without bound."""
    if command == "convert":
        src = copy_source(source[0], tmp_path / "hf")
        edit_json(os.path.join(src, "config.json"), num_hidden_layers=10**9)
        out = str(tmp_path / "out")
        line = one_error_line(limited([*CONVERT, src, out]), "kdtree-convert", 1)
        assert "config.json says num_hidden_layers=1000000000, but the safetensors hold weights of 3 layer(s) " \
               "(0..2)" in line, line
        assert sorted(os.listdir(tmp_path)) == ["hf"]
        return
    bad = str(tmp_path / "bad")
    shutil.copytree(source[1], bad)
    edit_json(os.path.join(bad, "config.json"), num_hidden_layers=10**9)
    cmd, prog, status = ([*CONVERT, "--verify", bad], "kdtree-convert", 1) if command == "verify" else \
        ([*GENERATE, bad], "kdtree-jax", 2)
    line = one_error_line(limited(cmd), prog, status)
    assert f"{bad}/config.json says 1000000000 layers (num_hidden_layers) but the checkpoint holds 3 " in line, line


def test_a_billion_layers_is_refused_in_well_under_a_second(source, tmp_path):
    """The API: kj.load, verify and convert raise at once (timed in the process, without its imports), and a
    num_nextn_predict_layers of 10**9 (multi-token-prediction layers, looked up from the tensor names) costs
    nothing: that dry run succeeds."""
    bad, src = str(tmp_path / "bad"), copy_source(source[0], tmp_path / "hf")
    shutil.copytree(source[1], bad)
    edit_json(os.path.join(bad, "config.json"), num_hidden_layers=10**9)
    edit_json(os.path.join(src, "config.json"), num_hidden_layers=10**9)
    proc = limited([sys.executable, "-c", TIMED, bad, src, str(tmp_path / "out")])
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and len(lines) == 3, proc.stdout + proc.stderr[-3000:]
    for line, name in zip(lines, ("load", "verify", "convert")):
        what, seconds, message = line.split(" ", 2)
        assert what == name and float(seconds) < 1.0 and "1000000000" in message, line
    edit_json(os.path.join(src, "config.json"), num_hidden_layers=3, num_nextn_predict_layers=10**9)
    proc = limited([*CONVERT, src, str(tmp_path / "out"), "--dry-run"], timeout=30)
    assert proc.returncode == 0 and "nothing was written" in proc.stdout, proc.stderr[-3000:]


def test_a_source_config_of_a_billion_experts_fails_at_once(source, tmp_path):
    """n_routed_experts of 10**9 in a source's config.json: each layer's experts are compared with the count without
    building the list 0..10**9-1 (which took 8 GB and minutes)."""
    src = copy_source(source[0], tmp_path / "hf")
    edit_json(os.path.join(src, "config.json"), n_routed_experts=10**9)
    line = one_error_line(limited([*CONVERT, src, str(tmp_path / "out")], timeout=30), "kdtree-convert", 1)
    assert "config.json says n_routed_experts=1000000000 and first_k_dense_replace=1, but layer 1 has routed " \
           "experts 0..15" in line, line


@pytest.mark.parametrize("key, value, message", [
    ("vocab_size", "264", "config field 'vocab_size' must be int, got '264'"),
    ("num_hidden_layers", "3", "config field 'num_hidden_layers' must be int, got '3'"),
    ("rope_parameters", [1], "config field 'rope_parameters' must be an object, got [1]"),
    ("rope_parameters", {"rope_type": "yarn", "factor": "32", "original_max_position_embeddings": 32},
     "config field 'rope_parameters.factor' must be float, got '32'"),
    ("q_lora_rank", 4.5, "config field 'q_lora_rank' must be int | None, got 4.5"),
    ("text_config", {"vocab_size": True}, "config field 'text_config.vocab_size' must be int, got True"),
    ("text_config", [], "config field 'text_config' must be an object, got []"),
])
def test_a_source_config_value_of_the_wrong_type_is_named(source, tmp_path, key, value, message):
    """A Hugging Face config.json with a value of the wrong JSON type: kdtree-convert names the file and the field,
    as kj.load does for a converted checkpoint's config (`config field 'vocab_size' must be int, got '264'`), not the
    comparison that failed inside ModelConfig."""
    src = copy_source(source[0], tmp_path / "hf")
    config = pathlib.Path(src, "config.json")
    if isinstance(value, dict) and key == "text_config":  # the K2.5 / K2.6 wrapper, one value of the wrong type
        value = {**json.loads(config.read_text()), **value}
    if key == "text_config":
        config.write_text(json.dumps({"model_type": "kimi_k25", "text_config": value}))
    else:
        edit_json(config, **{key: value})
    line = one_error_line(limited([*CONVERT, src, str(tmp_path / "out")]), "kdtree-convert", 1)
    assert line == f"kdtree-convert: error: {src}/config.json: {message}", line
    assert sorted(os.listdir(tmp_path)) == ["hf"]


@pytest.mark.parametrize("contents", ["empty", "config_only"])
def test_an_incomplete_drafter_directory_is_named(source, tmp_path, contents):
    """drafter/ in a checkpoint without its files: kdtree-convert --verify, kdtree-jax generate and kj.load name the
    checkpoint's drafter and the file it lacks (not a bare '[Errno 2] No such file or directory')."""
    bad = tmp_path / "bad"
    shutil.copytree(source[1], bad)
    drafter = bad / "drafter"
    drafter.mkdir()
    if contents == "empty":
        missing = "drafter_config.json is missing (the directory is empty; a checkpoint without a drafter has no " \
                  "drafter/ directory)"
    else:  # a valid config of a drafter for this target, without its weights
        (drafter / "drafter_config.json").write_text(json.dumps(
            {"num_layers": 1, "block_size": 4, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 4, "head_dim": 16,
             "intermediate_size": 128, "target_layer_ids": [1], "mask_token_id": 3, "vocab_size": 264,
             "target_num_layers": 3, "dtype": "float32"}))
        missing = "params.npz is missing"
    want = f"the checkpoint's drafter {drafter} is incomplete: {missing}"
    with pytest.raises(CheckpointError) as e:
        kj.load(str(bad))
    assert str(e.value) == want
    for cmd, prog, status in (([*CONVERT, "--verify", str(bad)], "kdtree-convert", 1),
                              ([*GENERATE, str(bad)], "kdtree-jax", 2)):
        assert one_error_line(limited(cmd), prog, status) == f"{prog}: error: {want}"


@pytest.mark.parametrize("kind, why", [
    ("file", "is not a directory (a drafter is a directory of drafter_config.json and params.npz)"),
    ("symlink_loop", "does not open: Too many levels of symbolic links")], ids=["file", "symlink_loop"])
def test_a_drafter_that_is_not_a_directory_is_named(source, tmp_path, kind, why):
    """Issue 46, fifth probe round: a drafter entry that was a file or a symlink loop was ignored (the model loaded
    without a drafter, and ddtree said later that it needs one). kj.load, kdtree-convert --verify and kdtree-jax
    generate now name it."""
    bad = tmp_path / "bad"
    shutil.copytree(source[1], bad)
    drafter = bad / "drafter"
    if kind == "file":
        drafter.write_text("{}")
    else:
        os.symlink("drafter", drafter)
    want = f"the checkpoint's drafter {drafter} {why}"
    with pytest.raises(CheckpointError) as e:
        kj.load(str(bad))
    assert str(e.value) == want
    for cmd, prog, status in (([*CONVERT, "--verify", str(bad)], "kdtree-convert", 1),
                              ([*GENERATE, str(bad)], "kdtree-jax", 2)):
        assert one_error_line(limited(cmd), prog, status) == f"{prog}: error: {want}"


@pytest.mark.parametrize("entry", ["../outside/model.safetensors", "absolute", "outside/../../outside/x", ".."])
def test_index_entries_outside_the_source_are_refused(source, tmp_path, entry):
    """model.safetensors.index.json's weight_map names shard files of the source directory: a path that leaves it
    (or an absolute one) is refused, naming the index and the entry, before that file is opened. Before, any file
    it named was opened and parsed as a safetensors file (here a valid one, whose tensors were read from its
    header; /etc/passwd gave 'corrupt safetensors header')."""
    src = copy_source(source[0], tmp_path / "hf")
    outside = tmp_path / "outside"
    outside.mkdir()
    os.rename(os.path.join(src, "model.safetensors"), outside / "model.safetensors")
    target = str(outside / "model.safetensors") if entry == "absolute" else entry
    names = sorted(conv.read_header(str(outside / "model.safetensors")))
    with open(os.path.join(src, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict.fromkeys(names, target)}, f)
    line = one_error_line(limited([*CONVERT, src, str(tmp_path / "out"), "--dry-run"]), "kdtree-convert", 1)
    assert line == (f"kdtree-convert: error: {src}/model.safetensors.index.json: weight_map entry {names[0]!r} "
                    f"names {target!r}, which is not a file name in {src} (shards are read from the source "
                    "directory only)"), line
    assert sorted(os.listdir(tmp_path)) == ["hf", "outside"]


# ---------------------------------------------------------------------------------------------------------------
# kdtree-jax generate: inputs refused before anything runs
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-45, 1e-39, 1e39])
def test_temperatures_outside_float32_are_refused(temperature):
    with pytest.raises(ValueError, match="outside float32's normal range"):
        kj.Sampler(temperature)
    assert kj.Sampler(1e-30).temperature == 1e-30  # small but normal: accepted


def test_cli_refuses_without_echoing_or_tracebacks(capsys):
    from kdtree_jax.cli import main as cli

    prompt = "never echo me " * 20000
    assert cli(["generate", "--prompt", prompt, "--max-new-tokens", "4"]) == 2
    out = capsys.readouterr()
    assert "never echo me" not in out.out + out.err and "exceed the model's context" in out.err
    assert cli(["generate", "--prompt", "x", "--temperature", "1e-45"]) == 2
    assert "use 0 for greedy" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli(["generate", "--prompt", "x", "--seed", str(2**64)])
    assert e.value.code == 2 and "the seed is an int64" in capsys.readouterr().err
    assert cli(["generate", "--model", "/nonexistent/ckpt", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kdtree-jax: error: /nonexistent/ckpt is not a kdtree-jax checkpoint")


@pytest.mark.parametrize("key, value, kind", [("vocab_size", "x", "int"), ("vocab_size", True, "int"),
                                              ("tie_word_embeddings", 0, "bool"), ("rope_type", 3, "str"),
                                              ("rms_norm_eps", "1e-6", "float"), ("ffi_ops", "tree_build", "tuple")])
def test_a_config_field_of_the_wrong_type_is_named(key, value, kind):
    """A checkpoint's config.json edited by hand: the error names the field and the type it needs, not a
    comparison that failed deep inside the config's checks. Values of the right types (an int for a float, None
    where allowed) still load."""
    from kdtree_jax.config import ConfigError, ModelConfig

    d = kj.configs.tiny().to_dict()
    with pytest.raises(ConfigError, match=rf"config field '{key}' must be {kind}"):
        ModelConfig.from_dict({**d, key: value})
    assert ModelConfig.from_dict({**d, "rms_norm_eps": 1, "q_lora_rank": None}).rms_norm_eps == 1


@pytest.mark.parametrize("field, value", [("eos_token_id", -5), ("bos_token_id", 999)])
def test_special_ids_outside_the_vocabulary_are_refused(source, tmp_path, field, value):
    """An eos id outside the vocabulary was accepted by --verify and generate and then never matched: the end token
    silently never ends a row."""
    bad = str(tmp_path / "bad")
    shutil.copytree(source[1], bad)
    edit_json(os.path.join(bad, "config.json"), **{field: value})
    line = one_error_line(limited([*CONVERT, "--verify", bad]), "kdtree-convert", 1)
    assert f"{field} {value} is outside the vocabulary [0, 264)" in line, line
    with pytest.raises(kj.checkpoint.CheckpointError, match=f"{field} {value} is outside the vocabulary"):
        kj.load(bad)


def _tokenizer_damage(ckpt: pathlib.Path, damage: str) -> None:
    model, config = ckpt / "tiktoken.model", ckpt / "tokenizer_config.json"
    target = config if damage.startswith("config") else model
    kind = damage.split("_", 1)[1]
    if kind in ("missing", "directory", "fifo", "loop", "dangling"):
        target.unlink()
    if kind == "directory":
        target.mkdir()
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "loop":
        target.symlink_to(target)
    elif kind == "dangling":
        target.symlink_to(ckpt / "nowhere")
    elif kind == "empty":
        target.write_text("")
    elif kind == "list":
        target.write_text("[1]")
    elif kind == "bad_added":
        target.write_text(json.dumps({"added_tokens_decoder": ["[BOS]"]}))
    elif kind == "unknown_eos":
        target.write_text(json.dumps({**json.loads(target.read_text()), "eos_token": "[NOPE]"}))


@pytest.mark.parametrize("damage, message", [
    ("model_missing", "tokenizer file tiktoken.model is missing"),
    ("config_missing", "tokenizer file tokenizer_config.json is missing"),
    ("model_dangling", "tokenizer file tiktoken.model is missing"),
    ("model_loop", "tokenizer file tiktoken.model does not open: Too many levels of symbolic links"),
    ("model_directory", "tokenizer file tiktoken.model is a directory"),
    ("model_fifo", "tokenizer file tiktoken.model is not a regular file"),
    ("config_fifo", "tokenizer file tokenizer_config.json is not a regular file"),
    ("model_empty", "tiktoken.model: holds no tokens"),
    ("config_list", "tokenizer_config.json must hold a JSON object, got \\[1\\]"),
    ("config_bad_added", "added_tokens_decoder must map token ids to tokens"),
    ("config_unknown_eos", "eos_token '\\[NOPE\\]' is not one of the special tokens"),
])
def test_tokenizer_files_the_manifest_lists_are_checked_by_load(source, tmp_path, damage, message):
    """kj.load of a checkpoint whose listed tiktoken.model was gone (or a symlink to nothing, or a loop) gave a byte
    tokenizer without a word, and one without its tokenizer_config.json a tokenizer without special tokens; a FIFO
    blocked the load forever; a directory, an empty file, a config that is a list or an end token that is no token
    were a bare IsADirectoryError, 'max() arg is an empty sequence', an AttributeError, or no end token at all. Each
    is now a CheckpointError naming the file, from kj.load and from kdtree-convert --verify alike."""
    import threading

    from ckpt_formats import write_tokenizer

    ckpt = tmp_path / "ckpt"
    shutil.copytree(source[1], ckpt)
    write_tokenizer(str(ckpt))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    (ckpt / "manifest.json").write_text(json.dumps({**manifest, "tokenizer_files": ["tiktoken.model",
                                                                                    "tokenizer_config.json"]}))
    assert type(kj.load(str(ckpt), verify=False).tokenizer).__name__ == "TiktokenTokenizer"
    _tokenizer_damage(ckpt, damage)
    got = {}

    def load():
        try:
            kj.load(str(ckpt), verify=False)
        except Exception as e:  # noqa: BLE001 (the test names what it wants below)
            got["error"] = e

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "kj.load blocked"
    assert isinstance(got.get("error"), CheckpointError) and re.search(message, str(got["error"])), got
    with pytest.raises(CheckpointError, match=message):
        conv.verify(str(ckpt))
