"""The support matrix covers every catalog kernel honestly, and the README table is generated from it."""

import ast
import pathlib

import jax_nkilib
from jax_nkilib._src.framework import registry
from jax_nkilib._src.framework.spec import FOLLOW_LNC
from jax_nkilib._src.tools.catalog import CATALOG
from jax_nkilib._src.tools.support import markdown_table, readme_section, sharding_table

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_catalog_kernel_has_one_row():
    rows = jax_nkilib.support_matrix()
    names = [row.kernel for row in rows]
    assert len(names) == len(set(names))
    assert {name for entry in CATALOG for name in entry.names} == set(names)
    assert [entry.row for entry in CATALOG] == list(range(1, 88))


def test_bound_rows_are_exactly_the_registered_catalog_kernels():
    rows = {row.kernel: row for row in jax_nkilib.support_matrix()}
    bound = {name for name, row in rows.items() if row.status == "bound"}
    for issue in (2, 3):  # done issues bind every kernel they plan
        assert {name for entry in CATALOG if entry.issue == issue for name in entry.names} <= bound
    assert rows["RoPE"].idiomatic == "jax_nkilib.rope" and "kernel" in rows["RoPE"].vjp
    assert rows["attention_cte"].idiomatic == "jax_nkilib.attention, jax_nkilib.dot_product_attention"
    assert "attention_bwd" in rows["attention_cte"].vjp
    assert "collectives" in rows["attention_kv_parallel_segmented_cte"].shard_map
    assert rows["attention_tkg"].idiomatic == "jax_nkilib.decode_attention"
    assert rows["bwmm_shard_on_block"].status.startswith("not bound yet") and rows["bwmm_shard_on_block"].layer1 == ""


def test_readme_table_is_generated_from_the_matrix():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme.count("| kernel | row |") == 1, "the support table must appear exactly once"
    assert readme_section(readme) == markdown_table(), (
        "README support table is stale: run `python -m jax_nkilib._src.tools.readme README.md`"
    )


def test_sharding_table_names_each_collective_once():
    # cross_entropy shards every leading letter with the same psum: its row says so once, not once per letter.
    row = next(line for line in sharding_table().splitlines() if line.startswith("| `jax_nkilib.cross_entropy`"))
    collective_cell = row.split(" | ")[2]
    assert collective_cell.count("one psum of the partial sum") == 1, collective_cell


def test_device_adapters_parse_and_match_their_specs():
    """jax_nkilib_kernels/ adapters import nki (absent here): check them statically against the specs they serve."""
    adapters = [
        k.spec for k in registry.bound_kernels().values() if k.spec.entry_point.startswith("jax_nkilib_kernels.")
    ]
    assert {"rope_hf", "attention_tkg", "gen_mask_tkg", "rmsnorm_tkg", "matmul_mxfp8"} <= {s.name for s in adapters}
    for spec in adapters:
        module, function = spec.entry_point.split(":")
        path = ROOT / "jax_nkilib_kernels" / (module.split(".", 1)[1].replace(".", "/") + ".py")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function]
        assert any(ast.unparse(d) == "nki.jit" for d in node.decorator_list)
        names = [a.arg for a in node.args.args]
        assert names == [o.name for o in spec.operands] + [p.name for p in spec.params]
        defaults = dict(
            zip(names[len(names) - len(node.args.defaults) :], (ast.literal_eval(d) for d in node.args.defaults))
        )
        for operand in spec.operands:
            assert (operand.name in defaults and defaults[operand.name] is None) == operand.optional
        for param in spec.params:  # an LNC-following flag is always passed resolved: any bool default will do
            if param.default is FOLLOW_LNC:
                assert isinstance(defaults[param.name], bool)
            else:
                assert defaults[param.name] == param.default, (spec.name, param.name)


def test_every_bound_kernel_is_exported_by_the_kernel_native_layer():
    bound = {row.kernel for row in jax_nkilib.support_matrix() if row.status == "bound"}
    assert bound <= set(jax_nkilib.nki.__all__)
    assert all(callable(getattr(jax_nkilib.nki, name)) for name in jax_nkilib.nki.__all__)
