"""The operator's entry point: `kopf run --standalone -m sparrowrl_operator.main` (the image's
command). It logs in as the pod's ServiceAccount (or the local kubeconfig) and registers the
handlers into kopf's default registry."""

from __future__ import annotations

import kopf
import kubernetes.client
import kubernetes.config

from sparrowrl_operator.clusters import Kube
from sparrowrl_operator.handlers import Config, Operator, register


def _home() -> kubernetes.client.ApiClient:
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return kubernetes.client.ApiClient()


@kopf.on.login()
def login(**kwargs) -> kopf.ConnectionInfo | None:
    return kopf.login_via_client(**kwargs)


register(kopf.get_default_registry(), Operator(Config.from_env(), Kube(_home())))
