use super::*;

const DISAGG: &str = r#"
version: 1
name: disagg
services:
  frontend:
    role: frontend
    gateway: {listen: "127.0.0.1:8000"}
    router: {policy: kv_aware}
  prefill:
    role: prefill
    replicas: 2
    topology: {required: rack}
    starts_after: [frontend]
    worker: {engine: mocker}
  decode:
    role: decode
    replicas: 2
    worker: {engine: mocker}
"#;

fn err(text: &str) -> String {
    DeploymentSpec::parse(text).unwrap_err().to_string()
}

#[test]
fn a_key_given_twice_is_refused() {
    let services = DISAGG.replace("  decode:\n", "  prefill:\n");
    let e = err(&services);
    assert!(e.contains("duplicate entry with key \"prefill\""), "{e}");
    let fields = DISAGG.replace(
        "    worker: {engine: mocker}\n  decode:",
        "    worker: {engine: mocker, engine: cpu}\n  decode:",
    );
    let e = err(&fields);
    assert!(e.contains("duplicate entry with key \"engine\""), "{e}");
}

#[test]
fn a_disaggregated_spec_parses() {
    let s = DeploymentSpec::parse(DISAGG).unwrap();
    assert_eq!(s.services.len(), 3);
    let p = s.service("prefill").unwrap();
    assert_eq!((p.replicas, p.resources.slots), (2, 1));
    assert_eq!(p.pack.required, Some(Level::Rack));
    assert_eq!(s.service("frontend").unwrap().resources.slots, 0);
    let (scopes, gangs) = s.gangs(&|_| true);
    assert_eq!(scopes.len(), 1);
    assert_eq!(scopes[0].key, "disagg/prefill");
    assert_eq!(gangs.len(), 5);
    assert!(gangs
        .iter()
        .any(|g| g.key == "disagg/prefill-1" && g.scopes == vec![0]));
    // The round trip keeps the meaning.
    let again = DeploymentSpec::parse(&s.to_yaml().unwrap()).unwrap();
    assert_eq!(again, s);
}

#[test]
fn a_planner_section_names_its_targets_and_fits_its_budget() {
    let with = |p: &str| format!("{DISAGG}planner:\n{p}");
    let s = DeploymentSpec::parse(&with(
        "  slot_budget: 6\n  services: {prefill: {min: 1, max: 4}, decode: {min: 1, max: 4}}\n",
    ))
    .unwrap();
    let p = s.planner.as_ref().unwrap();
    assert_eq!(p.targets.len(), 2);
    assert_eq!(s.target_slots("prefill"), Some(1));
    let again = DeploymentSpec::parse(&s.to_yaml().unwrap()).unwrap();
    assert_eq!(again, s);
    assert!(err(&with("  services: {frontend: {max: 2}}\n")).contains("planner.services.frontend"));
    assert!(err(&with("  services: {nope: {max: 2}}\n")).contains("planner.services.nope"));
    assert!(err(&with(
        "  slot_budget: 1\n  services: {prefill: {min: 1, max: 4}, decode: {min: 1, max: 4}}\n"
    ))
    .contains("planner.slot_budget"));
}

#[test]
fn groups_make_gangs_of_their_members() {
    let text = DISAGG.replace(
            "  decode:\n",
            "  pd2:\n    role: aggregated\n    worker: {engine: mocker}\n  decode:\n",
        ) + "groups:\n  pd:\n    services: [decode, pd2]\n    replicas: 3\n    topology: {required: host}\n";
    let s = DeploymentSpec::parse(&text).unwrap();
    let (_, gangs) = s.gangs(&|_| true);
    let pd: Vec<&Gang> = gangs
        .iter()
        .filter(|g| g.key.starts_with("disagg/pd-"))
        .collect();
    assert_eq!(pd.len(), 3);
    assert_eq!(pd[0].members.len(), 3);
    assert_eq!(pd[0].pack.required, Some(Level::Host));
    assert!(pd[0]
        .members
        .iter()
        .any(|m| m.key == "disagg/pd-0.decode-1"));
    let mut s2 = s.clone();
    assert!(s2
        .scale("decode", 4)
        .unwrap_err()
        .to_string()
        .contains("scale deployment/pd"));
    s2.scale("pd", 1).unwrap();
    // frontend, two prefill replicas and one group replica.
    assert_eq!(s2.gangs(&|_| true).1.len(), 4);
    assert!(s2
        .scale("nope", 1)
        .unwrap_err()
        .to_string()
        .contains("no service or group"));
    // A scale that would take the deployment past its bound in all is
    // refused, and leaves the spec as it was.
    let e = s2.scale("pd", 4096).unwrap_err().to_string();
    assert!(
        e.starts_with("cannot scale disagg/pd to 4096: the deployment would have"),
        "{e}"
    );
    assert_eq!(s2.group("pd").unwrap().replicas, 1);
}

#[test]
fn errors_name_the_field() {
    assert!(
        err(&DISAGG.replace("replicas: 2\n    topology", "replcas: 2\n    topology"))
            .contains("replcas")
    );
    assert!(err(&DISAGG.replace("version: 1", "version: 2")).contains("`version`"));
    assert!(err(&DISAGG.replace("name: disagg", "name: Dis_agg")).contains("`name`"));
    assert!(
        err(&DISAGG.replace("starts_after: [frontend]", "starts_after: [nobody]"))
            .contains("services.prefill.starts_after")
    );
    assert!(err(&DISAGG.replace(
        "worker: {engine: mocker}\n  decode",
        "worker: {role: x, engine: mocker}\n  decode"
    ))
    .contains("services.prefill.worker.role"));
    assert!(err(&DISAGG.replace(
        "    replicas: 2\n    worker",
        "    replicas: 2\n    resources: {slots: 65}\n    worker"
    ))
    .contains("services.decode.resources.slots"));
    assert!(err(&DISAGG.replace(
        "router: {policy: kv_aware}",
        "router: {policy: kv_aware}\n    worker: {engine: cpu}"
    ))
    .contains("services.frontend.worker"));
    assert!(
        err(&DISAGG.replace("    worker: {engine: mocker}\n  decode", "  decode"))
            .contains("services.prefill.worker")
    );
    assert!(err(&DISAGG.replace("role: decode", "role: decoder")).contains("decoder"));
}

#[test]
fn a_child_only_narrows_its_parent() {
    let text = DISAGG.replace(
        "name: disagg\n",
        "name: disagg\ntopology: {required: rack}\n",
    );
    assert!(DeploymentSpec::parse(&text).is_ok());
    let wider = text.replace(
        "topology: {required: rack}\n    starts",
        "topology: {required: zone}\n    starts",
    );
    let e = err(&wider);
    assert!(
        e.contains("services.prefill.topology.required") && e.contains("narrow"),
        "{e}"
    );
    let e = err(&DISAGG.replace("{required: rack}", "{required: rack, preferred: zone}"));
    assert!(e.contains("services.prefill.topology.preferred"), "{e}");
    let grouped = DISAGG.to_string()
        + "groups:\n  pd:\n    services: [prefill, decode]\n    topology: {required: host}\n";
    let e = err(&grouped);
    assert!(
        e.contains("services.prefill.topology.required") && e.contains("group pd"),
        "{e}"
    );
}

#[test]
fn start_order_cycles_are_refused() {
    let text = DISAGG.replace(
        "role: frontend\n",
        "role: frontend\n    starts_after: [prefill]\n",
    );
    assert!(err(&text).contains("cycle"));
}

#[test]
fn group_membership_is_checked() {
    let twice = DISAGG.to_string()
        + "groups:\n  a:\n    services: [decode]\n  b:\n    services: [decode]\n";
    assert!(err(&twice).contains("groups.b.services"));
    let missing = DISAGG.to_string() + "groups:\n  a:\n    services: [nope]\n";
    assert!(err(&missing).contains("groups.a.services"));
    let floor = DISAGG.to_string()
        + "groups:\n  a:\n    services: [decode]\n    replicas: 1\n    min_available: 2\n";
    assert!(err(&floor).contains("groups.a.min_available"));
}

#[test]
fn a_group_member_cannot_wait_for_another_member_when_applied() {
    let spec = |extra: &str| {
        DeploymentSpec::parse(&format!(
            "version: 1\nname: d\nservices:\n  a: {{role: prefill, starts_after: [{extra}], worker: {{engine: mocker}}}}\n  b: {{role: decode, worker: {{engine: mocker}}}}\n  x: {{role: aggregated, starts_after: [b], worker: {{engine: mocker}}}}\ngroups:\n  g: {{services: [a, b], replicas: 1}}\n"
        ))
        .expect("a stored spec of this shape still loads")
    };
    let e = spec("b").check_for_apply().unwrap_err().to_string();
    assert!(
        e.contains("services.a.starts_after") && e.contains("group \"g\""),
        "{e}"
    );
    // Through another service: g waits for x, which waits for g.
    let e = spec("x").check_for_apply().unwrap_err().to_string();
    assert!(e.contains("groups.g") && e.contains("cycle"), "{e}");
}

#[test]
fn planner_settings_that_cannot_work_are_refused_when_applied() {
    let spec = |planner: &str| {
        DeploymentSpec::parse(&format!(
            "version: 1\nname: d\nservices:\n  w: {{role: aggregated, worker: {{engine: mocker}}}}\nplanner: {{{planner}}}\n"
        ))
        .expect("a stored spec of this shape still loads")
    };
    for (p, field) in [
        ("services: {w: {min: 0, max: 0}}", "planner.services.w.max"),
        (
            "slot_budget: 0, services: {w: {max: 1}}",
            "planner.slot_budget",
        ),
        (
            "idle_to_zero_ms: 5000, services: {w: {min: 1, max: 2}}",
            "planner.idle_to_zero_ms",
        ),
    ] {
        let e = spec(p).check_for_apply().unwrap_err().to_string();
        assert!(e.contains(field), "{p}: {e}");
    }
    assert!(
        spec("idle_to_zero_ms: 5000, services: {w: {min: 0, max: 2}}")
            .check_for_apply()
            .is_ok()
    );
}

#[test]
fn top_level_x_keys_hold_anchors_that_services_merge() {
    let s = DeploymentSpec::parse(
        "version: 1\nname: d\nx-worker: &w\n  role: aggregated\n  worker: {engine: mocker}\nservices:\n  a:\n    <<: *w\n    replicas: 2\n  b: *w\n",
    )
    .unwrap();
    assert_eq!(s.service("a").unwrap().replicas, 2);
    assert_eq!(s.service("b").unwrap().replicas, 1);
    // Other unknown top-level keys are still refused, naming the field.
    let e = DeploymentSpec::parse("version: 1\nname: d\nxx: 1\nservices: {}\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("xx"), "{e}");
    let e = DeploymentSpec::parse(
        "version: 1\nname: d\nx-w: &w {role: aggregated, replcas: 2}\nservices:\n  a: *w\n",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("replcas"), "{e}");
}
