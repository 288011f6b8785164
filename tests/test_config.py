"""The ``[elastic_gpu]`` settings: lookup order, types, and the table that feeds ``airflow config``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from airflow_elastic_gpu import config, get_provider_info
from airflow_elastic_gpu.broker.api_guards import ApiLimits

PACKAGE = Path(config.__file__).parent
#: variables read by the sidecar agent in the training pod, where there is no Airflow
POD_SIDE = {"AIRFLOW_ELASTIC_GPU_BROKER_API", "AIRFLOW_ELASTIC_GPU_JOB_TOKEN"}


class FakeConf:
    """What the functions use of Airflow's ``conf``: ``get(section, key, fallback=...)``."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def get(self, section: str, key: str, **kwargs):
        assert section == "elastic_gpu"
        return self.values.get(key, kwargs.get("fallback"))


def test_the_historical_variable_wins_over_airflows_variable_and_airflow_cfg(tmp_path):
    (tmp_path / "airflow.cfg").write_text("[elastic_gpu]\nwork_dir = /from/cfg\n")
    env = {"AIRFLOW_HOME": str(tmp_path), "AIRFLOW_ELASTIC_GPU_WORK_DIR": "/from/old",
           "AIRFLOW__ELASTIC_GPU__WORK_DIR": "/from/airflow-env"}
    assert config.default_work_dir(env) == Path("/from/old")
    del env["AIRFLOW_ELASTIC_GPU_WORK_DIR"]
    assert config.default_work_dir(env) == Path("/from/airflow-env")
    del env["AIRFLOW__ELASTIC_GPU__WORK_DIR"]
    assert config.default_work_dir(env) == Path("/from/cfg")


def test_airflow_cfg_is_found_through_airflow_config_as_airflow_finds_it(tmp_path):
    cfg = tmp_path / "elsewhere.cfg"
    cfg.write_text("[elastic_gpu]\ndefault_pool = a100\nvirtual_gpus = 8\n")
    env = {"AIRFLOW_HOME": str(tmp_path / "home"), "AIRFLOW_CONFIG": str(cfg)}
    assert config.default_pool(env) == "a100"
    assert config.default_virtual_gpus(env) == 8


def test_unset_options_take_the_tables_defaults_and_the_computed_paths(tmp_path):
    env = {"AIRFLOW_HOME": str(tmp_path)}
    assert config.default_broker_url(env) == f"sqlite:///{tmp_path / 'elastic_gpu_broker.db'}"
    assert config.default_work_dir(env) == tmp_path / "elastic_gpu_jobs"
    assert config.default_pool(env) == "default"
    assert config.default_poll_interval_s(env) == 5.0
    assert config.default_deferrable(env) is True
    assert config.default_virtual_gpus(env) == 4
    assert config.default_broker_api_url(env) is None
    assert ApiLimits.from_env(env) == ApiLimits()


def test_airflows_conf_is_asked_when_given_and_the_historical_variable_still_wins(tmp_path):
    conf = FakeConf({"broker_url": "postgresql+psycopg://db/broker", "default_deferrable": "False"})
    env = {"AIRFLOW_HOME": str(tmp_path)}
    assert config.default_broker_url(env, conf) == "postgresql+psycopg://db/broker"
    assert config.default_deferrable(env, conf) is False
    env["AIRFLOW_ELASTIC_GPU_BROKER_URL"] = "sqlite:////x.db"
    assert config.default_broker_url(env, conf) == "sqlite:////x.db"


@pytest.mark.parametrize("option,value,message", [
    ("poll_interval", "soon", r"\$AIRFLOW__ELASTIC_GPU__POLL_INTERVAL must be a float, got 'soon'"),
    ("default_deferrable", "maybe", r"\$AIRFLOW__ELASTIC_GPU__DEFAULT_DEFERRABLE must be a boolean, got 'maybe'"),
    ("virtual_gpus", "four", r"\$AIRFLOW__ELASTIC_GPU__VIRTUAL_GPUS must be an integer, got 'four'"),
])
def test_a_value_of_the_wrong_type_is_refused_with_the_option_named(tmp_path, option, value, message):
    env = {"AIRFLOW_HOME": str(tmp_path), f"AIRFLOW__ELASTIC_GPU__{option.upper()}": value}
    getter = {"poll_interval": config.default_poll_interval_s, "default_deferrable": config.default_deferrable,
              "virtual_gpus": config.default_virtual_gpus}[option]
    with pytest.raises(ValueError, match=message):
        getter(env)


def test_an_api_limit_from_airflow_cfg_that_is_not_a_number_names_the_option(tmp_path):
    (tmp_path / "airflow.cfg").write_text("[elastic_gpu]\napi_max_body_bytes = 64k\n")
    with pytest.raises(ValueError, match=r"\[elastic_gpu\] api_max_body_bytes \(.*airflow.cfg\) must be a positive integer"):
        ApiLimits.from_env({"AIRFLOW_HOME": str(tmp_path)})


def test_a_bad_value_is_named_by_where_it_came_from_not_by_another_place_that_could_set_it(tmp_path):
    """A message that named ``$AIRFLOW_ELASTIC_GPU_VIRTUAL_GPUS`` for a value set in airflow.cfg sent
    the user looking for a variable they never set."""
    cfg = tmp_path / "airflow.cfg"
    cfg.write_text("[elastic_gpu]\nvirtual_gpus = eight\napi_max_metrics_bytes = -1\n")
    env = {"AIRFLOW_HOME": str(tmp_path)}
    with pytest.raises(ValueError) as err:
        config.default_virtual_gpus(env)
    assert str(err.value) == f"[elastic_gpu] virtual_gpus ({cfg}) must be an integer, got 'eight'"
    with pytest.raises(ValueError, match=r"^\$AIRFLOW_ELASTIC_GPU_VIRTUAL_GPUS must be an integer, got 'x'$"):
        config.default_virtual_gpus({**env, "AIRFLOW_ELASTIC_GPU_VIRTUAL_GPUS": "x"})
    with pytest.raises(ValueError, match=r"^\[elastic_gpu\] poll_interval must be a float, got 'soon'$"):
        config.default_poll_interval_s(env, FakeConf({"poll_interval": "soon"}))
    # a number that is not positive is named too (it used to reach ApiLimits, which names no source)
    with pytest.raises(ValueError) as err:
        ApiLimits.from_env(env)
    assert str(err.value) == f"[elastic_gpu] api_max_metrics_bytes ({cfg}) must be a positive integer (bytes), got '-1'"
    with pytest.raises(ValueError, match=r"^\$AIRFLOW__ELASTIC_GPU__API_MAX_BODY_BYTES must be a positive"):
        ApiLimits.from_env({**env, "AIRFLOW__ELASTIC_GPU__API_MAX_BODY_BYTES": "0"})


def test_lookup_option_says_which_layer_gave_the_value(tmp_path):
    env = {"AIRFLOW_HOME": str(tmp_path)}
    assert config.lookup_option("default_pool", env) == ("default", "the default of [elastic_gpu] default_pool")
    assert config.lookup_option("default_pool", env, FakeConf({"default_pool": "a100"})) == (
        "a100", "[elastic_gpu] default_pool")
    env["AIRFLOW__ELASTIC_GPU__DEFAULT_POOL"] = "v100"
    assert config.lookup_option("default_pool", env) == ("v100", "$AIRFLOW__ELASTIC_GPU__DEFAULT_POOL")


def test_every_airflow_elastic_gpu_variable_the_package_reads_is_an_option_of_the_config_section():
    used = set()
    for path in PACKAGE.rglob("*.py"):
        used |= set(re.findall(r"AIRFLOW_ELASTIC_GPU_[A-Z_]+[A-Z]", path.read_text()))
    declared = {o.env for o in config.OPTIONS if o.env}
    assert used - POD_SIDE <= declared, f"not in the [elastic_gpu] section: {sorted(used - POD_SIDE - declared)}"
    assert declared <= used


def test_the_provider_metadata_declares_every_option_with_type_default_and_description():
    section = get_provider_info()["config"]["elastic_gpu"]["options"]
    assert set(section) == {o.name for o in config.OPTIONS}
    for name, option in section.items():
        assert option["type"] in ("string", "integer", "float", "boolean"), name
        assert isinstance(option["default"], str) and option["description"].strip(), name
    assert section["broker_url"]["sensitive"] and section["ui_token"]["sensitive"]


def test_the_provider_metadata_declares_the_connection_forms_fields_and_hides_the_standard_ones():
    (conn,) = get_provider_info()["connection-types"]
    assert conn["connection-type"] == "elastic_gpu"
    assert set(conn["conn-fields"]) == {"url", "pool", "api_url"}
    assert conn["conn-fields"]["url"]["schema"]["format"] == "password"  # it holds the DB password
    assert set(conn["ui-field-behaviour"]["hidden-fields"]) >= {"host", "schema", "login", "password", "port"}


def test_airflow_cfg_is_read_with_airflows_escapes(tmp_path):
    """Airflow's parser reads ``%%`` as ``%`` (a URL-encoded password must be written so in
    airflow.cfg): the CLI and the broker server read the same password as the operators."""
    (tmp_path / "airflow.cfg").write_text("[elastic_gpu]\nbroker_url = postgresql+psycopg://u:p%%40ss@h/db\n")
    env = {"AIRFLOW_HOME": str(tmp_path)}
    assert config.default_broker_url(env) == "postgresql+psycopg://u:p%40ss@h/db"
    (tmp_path / "airflow.cfg").write_text("[elastic_gpu]\nbroker_url = postgresql+psycopg://u:p%40ss@h/db\n")
    with pytest.raises(ValueError, match=r"cannot read \[elastic_gpu\] broker_url .*write % as %%"):
        config.default_broker_url(env)


def test_a_percent_in_airflow_cfg_is_refused_without_echoing_the_value(tmp_path):
    """configparser's message quotes the rest of the value after the ``%``: the password of a
    percent-encoded broker URL ended up in the error."""
    (tmp_path / "airflow.cfg").write_text("[elastic_gpu]\nbroker_url = postgresql+psycopg://u:s3cr%40et@h/db\n")
    with pytest.raises(ValueError) as err:
        config.default_broker_url({"AIRFLOW_HOME": str(tmp_path)})
    message = str(err.value)
    assert "broker_url" in message and "write % as %%" in message
    assert "s3cr" not in message and "40et" not in message and "postgresql" not in message


def test_a_line_airflow_cfg_cannot_parse_is_named_by_its_number_not_its_text(tmp_path):
    (tmp_path / "airflow.cfg").write_text("broker_url = postgresql://u:s3cret@h/db\n[elastic_gpu]\n")
    with pytest.raises(ValueError) as err:
        config.default_broker_url({"AIRFLOW_HOME": str(tmp_path)})
    assert "cannot be parsed (line 1" in str(err.value) and "s3cret" not in str(err.value)


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql+psycopg://u:s3cret@db:5432/broker", "postgresql+psycopg://u:***@db:5432/broker"),
    ("postgresql//u:s3cret@host/db", "***@host/db"),  # no "://": SQLAlchemy cannot parse it
    ("postgresql:/u:s3cret@host/db", "***@host/db"),
    ("u:s3cret@host/db", "***@host/db"),
    ("postgresql://u:s3c@ret@h/db", "postgresql://***@h/db"),  # an unencoded @ in the password
    ("postgresql//u:s3c@ret@h/db", "***@h/db"),
    ("postgresql://u@h/db?password=s3cret&sslmode=require", "postgresql://u@h/db?password=***&sslmode=require"),
    ("postgresql://h/db?sslpassword=s3cret&sslkey=/k/s3cret.key",
     "postgresql://h/db?sslkey=***&sslpassword=***"),
    ("postgresql//h/db?PASSWORD=s3cret#x", "postgresql//h/db?PASSWORD=***#x"),
    ("sqlite:////tmp/broker.db", "sqlite:////tmp/broker.db"),
])
def test_mask_url_hides_every_form_of_password(url, shown):
    assert config.mask_url(url) == shown
    assert "s3c" not in config.mask_url(url) and "ret@" not in config.mask_url(url)
