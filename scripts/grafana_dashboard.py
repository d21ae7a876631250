#!/usr/bin/env python3
"""Writes cluster-config/grafana/dynamo-dashboard.json, the SLA dashboard.

Edit the panels here and run `python3 scripts/grafana_dashboard.py`; the
integration test `dashboard_metrics_exist` (integration/tests/planner.rs)
checks that every metric the dashboard names is exported by a running
cluster.
"""
import json
import os

panels = []
y = 0
DS = {"type": "prometheus", "uid": "${datasource}"}
N = '{namespace=~"$namespace"}'
APPLIED = '{namespace=~"$namespace",applied="true"}'


def row(title):
    global y
    panels.append({"type": "row", "title": title, "collapsed": False,
                   "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                   "id": len(panels) + 1, "panels": []})
    y += 1


def ts(title, exprs, unit="short", w=12, x=0, desc=""):
    panels.append({
        "type": "timeseries", "title": title, "description": desc,
        "id": len(panels) + 1, "datasource": DS,
        "gridPos": {"h": 8, "w": w, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "multi"}},
        "targets": [{"refId": chr(65 + i), "expr": e, "legendFormat": l, "datasource": DS}
                    for i, (e, l) in enumerate(exprs)],
    })


def q(quantile, metric, by=""):
    b = "le" + (", " + by if by else "")
    return (f"histogram_quantile({quantile}, sum by ({b}) "
            f"(rate({metric}_bucket{N}[$__rate_interval])))")


def rate(metric, by):
    return f"sum by ({by}) (rate({metric}{N}[$__rate_interval]))"


def pcts(metric, qs=(0.5, 0.9, 0.99)):
    return [(q(p, metric), f"p{int(p * 100)}") for p in qs]


def main():
    global y
    row("SLA: latency")
    ts("Time to first token (gateway)", pcts("dynamo_gateway_time_to_first_token_seconds"),
       "s", 12, 0, "Client-side TTFT percentiles; compare with the planner's ttft_ms.")
    ts("Inter-token latency (gateway)", pcts("dynamo_gateway_inter_token_latency_seconds"),
       "s", 12, 12, "ITL percentiles; compare with the planner's itl_ms.")
    y += 8
    ts("Requests by status", [(rate("dynamo_gateway_requests_total", "status"), "{{status}}")],
       "reqps", 12, 0)
    ts("End-to-end request time",
       pcts("dynamo_gateway_request_duration_seconds", (0.5, 0.99)), "s", 12, 12)
    y += 8
    row("Queue and admission")
    ts("Requests waiting for admission",
       [(f"sum(dynamo_gateway_queued_requests{N})", "queued"),
        (f"sum(dynamo_gateway_inflight_requests{N})", "in flight")], "short", 8, 0)
    ts("Queue wait", pcts("dynamo_gateway_queue_wait_seconds", (0.5, 0.99)), "s", 8, 8)
    ts("Admission rejections (429/503)",
       [(rate("dynamo_gateway_rejected_requests_total", "reason"), "{{reason}}")],
       "reqps", 8, 16)
    y += 8
    ts("Worker queues",
       [(f"sum by (worker) (dynamo_worker_waiting_seqs{N})", "waiting {{worker}}"),
        (f"sum by (worker) (dynamo_worker_active_seqs{N})", "active {{worker}}")],
       "short", 12, 0)
    ts("Prompt tokens waiting for a first token",
       [(f"sum by (role) (dynamo_worker_queued_prefill_tokens{N})", "{{role}}")],
       "short", 12, 12)
    y += 8
    row("KV cache")
    cached = f"sum(rate(dynamo_gateway_cached_tokens_total{N}[$__rate_interval]))"
    predicted = f"sum(rate(dynamo_gateway_predicted_cached_tokens_total{N}[$__rate_interval]))"
    prompt = f"sum(rate(dynamo_gateway_input_tokens_total{N}[$__rate_interval]))"
    ts("KV hit rate (prompt tokens served from cache)",
       [(f"{cached} / {prompt}", "cached / prompt"),
        (f"{predicted} / {prompt}", "predicted by the router")], "percentunit", 12, 0)
    ts("KV utilisation per worker",
       [(f"sum by (worker) (dynamo_worker_kv_used_blocks{N}) / "
         f"sum by (worker) (dynamo_worker_kv_total_blocks{N})", "{{worker}}")],
       "percentunit", 12, 12)
    y += 8
    ts("Blocks in the router's index",
       [(f"max by (tier) (dynamo_router_kv_index_blocks{N})", "{{tier}}")], "short", 12, 0)
    ts("Routing decision time", pcts("dynamo_router_route_seconds", (0.5, 0.99)), "s", 12, 12)
    y += 8
    row("Faults")
    ts("Migrations",
       [(rate("dynamo_gateway_migrations_total", "reason"), "{{reason}}"),
        (rate("dynamo_gateway_migration_failures_total", "why"), "not migrated: {{why}}")],
       "reqps", 8, 0)
    ts("Worker request outcomes",
       [(rate("dynamo_worker_requests_total", "outcome"), "{{outcome}}")], "reqps", 8, 8)
    ts("Actor restarts and bus",
       [(f"sum by (node) (increase(dynamo_node_actor_restarts_total{N}[$__rate_interval]))",
         "restarts {{node}}"),
        (f"min by (node) (dynamo_node_bus_connected{N})", "bus connected {{node}}")],
       "short", 8, 16)
    y += 8
    row("Scaling")
    ts("Replicas: desired, recommended, ready",
       [(f"sum by (deployment, target) (dynamo_planner_{k}_replicas{N})",
         k + " {{deployment}}/{{target}}") for k in ("desired", "recommended", "ready")],
       "short", 12, 0)
    ts("Scaling decisions applied",
       [(f"sum by (target, direction, rule) "
         f"(increase(dynamo_planner_decisions_total{APPLIED}[$__rate_interval]))",
         "{{target}} {{direction}} ({{rule}})")], "short", 12, 12)
    y += 8
    ts("Worker TTFT (from acceptance, by role)",
       [(q(0.99, "dynamo_worker_time_to_first_token_seconds", "role"), "p99 {{role}}"),
        (q(0.5, "dynamo_worker_time_to_first_token_seconds", "role"), "p50 {{role}}")],
       "s", 12, 0)
    ts("Controller",
       [(f"max by (node) (dynamo_controller_active{N})", "active {{node}}"),
        (rate("dynamo_controller_reconciles_total", "result"), "reconciles {{result}}")],
       "short", 12, 12)
    y += 8
    dashboard = {
        "title": "Dynamo: serving SLA", "uid": "dynamo-sla", "tags": ["dynamo", "llm"],
        "timezone": "browser", "schemaVersion": 39, "version": 1, "editable": True,
        "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
        "description": ("TTFT and ITL percentiles, queues and admission, KV hit rate, "
                        "migrations and scaling decisions. Scrape each node once: a gateway's "
                        "/metrics where the node runs one (it includes the node's own series), "
                        "else the node's listener ([metrics] listen or --metrics-listen); "
                        "a `namespace` label on the scrape job selects a deployment."),
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus",
             "label": "Prometheus", "current": {}},
            {"name": "namespace", "type": "custom", "label": "namespace label",
             "query": ".*", "current": {"text": ".*", "value": ".*"}, "options": [],
             "description": "Regular expression on the scrape job's namespace label"},
        ]},
        "panels": panels,
    }
    here = os.path.dirname(os.path.abspath(__file__))
    out = os.path.join(here, "..", "cluster-config", "grafana", "dynamo-dashboard.json")
    with open(out, "w") as f:
        f.write(json.dumps(dashboard, indent=2) + "\n")


if __name__ == "__main__":
    main()
