"""Settings come from the environment; typos and missing credentials fail with their names."""

import pytest

from aerie.settings import Settings, SettingsError
from tests.services import clean_env


def test_defaults_are_the_embedded_store(monkeypatch):
    monkeypatch.setattr("os.environ", clean_env())
    s = Settings.load()
    assert s.store.startswith("file://") and s.broker == "memory://" and s.embedded


def test_unknown_variable_is_an_error(monkeypatch):
    monkeypatch.setenv("AERIE_BUCKIT", "x")
    with pytest.raises(ValueError, match="AERIE_BUCKIT"):
        Settings.load()


def test_s3_store_needs_credentials(monkeypatch):
    monkeypatch.setenv("AERIE_STORE", "http://127.0.0.1:9000")
    monkeypatch.delenv("AERIE_S3_ACCESS_KEY", raising=False)
    monkeypatch.delenv("AERIE_S3_SECRET_KEY", raising=False)
    with pytest.raises(ValueError, match="AERIE_S3_ACCESS_KEY, AERIE_S3_SECRET_KEY"):
        Settings.load()
    monkeypatch.setenv("AERIE_S3_ACCESS_KEY", "a")
    monkeypatch.setenv("AERIE_S3_SECRET_KEY", "very-secret-value")
    s = Settings.load()
    assert "very-secret-value" not in repr(s) and "very-secret-value" not in str(s.model_dump())  # secrets never print


def test_lists_and_numbers_parse_from_env(monkeypatch):
    monkeypatch.setenv("AERIE_ENGINE_URLS", '["http://a:1", "http://b:2"]')
    monkeypatch.setenv("AERIE_WORKER_CONCURRENCY", "3")
    s = Settings.load()
    assert s.engine_urls == ["http://a:1", "http://b:2"] and s.worker_concurrency == 3
    monkeypatch.setenv("AERIE_WORKER_CONCURRENCY", "0")
    with pytest.raises(SettingsError, match="AERIE_WORKER_CONCURRENCY='0': Input should be greater than or equal to 1"):
        Settings.load()


def test_reserved_prefixes_are_not_settings(monkeypatch):
    # the test harness and the SGLang plugin own these names; they never reach Settings
    monkeypatch.setenv("AERIE_TEST_S3_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("AERIE_CAPTURE_DIR", "/dev/shm/x")
    Settings.load()
