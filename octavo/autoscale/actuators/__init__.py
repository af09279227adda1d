"""What carries out the policy's decisions: ``Actuator`` (base.py) and its
implementations, local processes (local.py) and a Kubernetes Deployment
(kubernetes.py)."""
