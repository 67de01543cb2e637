from zpp_jax.cli import entry

entry()
