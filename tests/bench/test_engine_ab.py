"""bench.engine_ab on the tiny backbone: each value's engine serves the workload to the end and is
reported; a field that is not a worded EngineConfig setting is refused; weight_build makes each
engine with its build of the weight kernel."""

import pytest

from bench.engine_ab import main


def test_each_value_is_timed_and_reported(capsys):
    main(["--backbone", "tiny", "--tasks", "2", "--requests", "4", "--out-max", "6", "--repeats", "2",
          "--dtype", "float32", "--field", "elementwise_kernel", "--values", "on", "off"])
    out = capsys.readouterr().out
    for value in ("on", "off"):
        assert out.count(f"elementwise_kernel={value}: ") == 3  # two repeats, then the median
        assert f"elementwise_kernel={value}: median" in out


def test_dtype_is_a_field_each_engine_serves_its_own(capsys):
    main(["--backbone", "tiny", "--tasks", "2", "--requests", "2", "--out-max", "4", "--repeats", "1",
          "--field", "dtype", "--values", "float32", "bfloat16"])
    out = capsys.readouterr().out
    assert "dtype=float32 runs in float32" in out
    assert "dtype=bfloat16 runs in bfloat16" in out
    assert "dtype=bfloat16: median" in out


def test_a_field_that_is_not_a_worded_setting_is_refused():
    with pytest.raises(SystemExit, match="set by a word"):
        main(["--backbone", "tiny", "--field", "max_batch_rows", "--values", "8", "16"])


def test_weight_build_makes_each_engine_with_that_build_of_the_kernel(monkeypatch, capsys):
    import bench.engine_ab as ab
    from server.engines.native.kernels import quant_linear

    made, real = [], ab.NativeEngine

    def engine(*args, **kwargs):
        made.append(quant_linear.KERNEL.flags)
        return real(*args, **kwargs)

    monkeypatch.setattr(ab, "NativeEngine", engine)
    main(["--backbone", "tiny", "--tasks", "2", "--requests", "2", "--out-max", "4", "--repeats", "1",
          "--dtype", "float32", "--field", "weight_build", "--values", "native", "avx2"])
    assert made == [(), ("-mno-avx512f",)]
    assert quant_linear.KERNEL is quant_linear.BUILDS["native"]  # put back after each engine
    assert "weight_build=avx2: median" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="weight_build takes avx2, native"):
        main(["--backbone", "tiny", "--field", "weight_build", "--values", "native", "sse"])
