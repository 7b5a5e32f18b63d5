"""A job's config module as torchtitan's `--module titan_jobs --config ...` imports it
(tests/trainers/test_torchtitan_trainer.py): torchtitan's llama3_debugmodel, watched by
the documented line."""

from torchtitan.models.llama3.config_registry import llama3_debugmodel

from flashwatch.integrations.torchtitan import watched


def llama3_debugmodel_watched():
    return watched(llama3_debugmodel(), mitigation="auto", every_n_steps=10)
