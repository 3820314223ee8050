"""The metrics writer's TensorBoard events are written without importing torch (tensorboardX imports it at module
level when it is installed: about 2 s of every trainer process's start), and they hold the scalars."""

import struct
import subprocess
import sys
import textwrap

from tensorboardX.proto import event_pb2


def _events(path):
    """The Event protos of a TFRecord file (length u64, its crc, the data, its crc)."""
    data, out, i = path.read_bytes(), [], 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i : i + 8])
        out.append(event_pb2.Event.FromString(data[i + 12 : i + 12 + n]))
        i += 12 + n + 4
    return out


def test_the_writer_keeps_torch_out_and_writes_the_scalars(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys
        from lpt.train.metrics import MetricsWriter
        w = MetricsWriter({str(tmp_path)!r})
        w.write(3, {{"loss": 2.5, "lr": 1e-3}})
        w.close()
        assert "torch" not in sys.modules, "tensorboardX imported torch"
        import importlib.util
        if importlib.util.find_spec("torch") is not None:  # installed (Python 3.11's dev extras): importable again
            import torch
            assert torch.__name__ == "torch"
        print("ok")
        """
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-2000:]
    (events,) = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    scalars = {v.tag: (e.step, v.simple_value) for e in _events(events) for v in e.summary.value}
    assert scalars["train/loss"] == (3, 2.5)
    assert abs(scalars["train/lr"][1] - 1e-3) < 1e-9
