"""POST /admin/scale and GET /admin/status on the router app, against a fake controller."""
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from deploy.admin import admin_routes
from deploy.client import ControllerUnavailable
from router.errors import install_error_handlers


class FakeController:
    def __init__(self):
        self.calls = []
        self.restarting = False

    async def scale(self, prefill=None, decode=None, colocated=None, drain=None):
        self.calls.append(("scale", prefill, decode, colocated, drain))
        if decode == 0 and colocated in (None, 0):
            raise ValueError("1 prefill worker(s) but no decode worker to send their KV to")
        targets = {"prefill": 1 if prefill is None else prefill, "decode": 1 if decode is None else decode, "both": 0}
        if targets["decode"] > 8:
            return {"targets": targets, "warning": "9 worker(s) need 4.5 CPUs (the cluster has 2)"}
        return {"targets": targets}

    async def wait_settled(self, timeout_s):
        self.calls.append(("wait", timeout_s))
        return {"targets": {"prefill": 1, "decode": 2, "both": 0}, "settled": True, "workers": [], "events": []}

    async def status(self):
        if self.restarting:
            raise ControllerUnavailable("the controller is not answering (restarting?): ActorUnavailableError")
        return {"targets": {"prefill": 1, "decode": 1, "both": 0}, "settled": True, "workers": [], "events": []}


@pytest.fixture
def admin():
    controller = FakeController()
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(admin_routes(controller, api_key="secret"))
    return TestClient(app), controller


AUTH = {"Authorization": "Bearer secret"}


def test_scale_needs_the_api_key(admin):
    client, controller = admin
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = client.post("/admin/scale", json={"decode": 2}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/admin/status").status_code == 401
    assert controller.calls == []


def test_scale_sets_targets_and_can_wait(admin):
    client, controller = admin
    response = client.post("/admin/scale", json={"decode": 2}, headers=AUTH)
    assert response.status_code == 200
    assert response.json() == {"targets": {"prefill": 1, "decode": 2, "both": 0}}
    response = client.post("/admin/scale", json={"decode": 2, "drain": ["127.0.0.1:5"], "wait": True,
                                                 "timeout_s": 30}, headers=AUTH)
    assert response.json()["settled"] is True
    assert controller.calls == [("scale", None, 2, None, []), ("scale", None, 2, None, ["127.0.0.1:5"]),
                                ("wait", 30.0)]
    assert client.get("/admin/status", headers=AUTH).json()["targets"]["decode"] == 1
    response = client.post("/admin/scale", json={"decode": 9}, headers=AUTH)
    assert response.json()["warning"] == "9 worker(s) need 4.5 CPUs (the cluster has 2)"


@pytest.mark.parametrize("body, message, param", [
    ({"decode": -1}, "decode must be an integer >= 0, got -1", "decode"),
    ({"decode": "2"}, "decode must be an integer >= 0, got '2'", "decode"),
    ({"decode": True}, "decode must be an integer >= 0, got True", "decode"),
    ({"wait": True}, "nothing to scale: send at least one of prefill, decode, colocated", None),
    ({"decode": 2, "replicas": 3}, "unknown field(s) replicas", "replicas"),
    ({"decode": 2, "drain": "127.0.0.1:5"}, "drain must be a list of worker addresses", "drain"),
    ({"decode": 2, "wait": True, "timeout_s": 0}, "timeout_s must be a number > 0, got 0", "timeout_s"),
    ({"decode": 0}, "no decode worker to send their KV to", None),
])
def test_bad_scale_requests_are_400_with_a_message(admin, body, message, param):
    client, controller = admin
    response = client.post("/admin/scale", json=body, headers=AUTH)
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param
    assert all(call[0] != "wait" for call in controller.calls)


def test_a_body_that_is_not_a_json_object_is_refused(admin):
    client, _ = admin
    for content in (b"{not json", b"[1, 2]", b""):
        response = client.post("/admin/scale", content=content, headers={**AUTH, "Content-Type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


def test_without_an_api_key_the_routes_are_open():
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(admin_routes(FakeController(), api_key=None))
    assert TestClient(app).post("/admin/scale", json={"decode": 3}).json()["targets"]["decode"] == 3


def test_a_restarting_controller_is_a_503_with_retry_after(admin):
    client, controller = admin
    controller.restarting = True
    response = client.get("/admin/status", headers=AUTH)
    assert response.status_code == 503 and response.headers["Retry-After"] == "5"
    assert "restarting" in response.json()["error"]["message"]


def test_the_client_turns_an_actor_that_cannot_answer_into_controller_unavailable():
    import asyncio

    from ray.exceptions import ActorDiedError

    from deploy.client import ControllerClient

    class Method:
        def remote(self, *args):
            async def fail():
                raise ActorDiedError()
            return fail()

    class Actor:
        status = Method()

    with pytest.raises(ControllerUnavailable, match="not answering"):
        asyncio.run(ControllerClient(Actor()).status())
