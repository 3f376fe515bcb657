#!/usr/bin/env bash
# Renders the chart into the plain manifests committed beside it (make
# manifests), or with --check fails when they are stale (make test):
#   deploy/manifests/inpod.yaml  the chart with default values, plus its Namespace
#   deploy/rbac/{agent,plugin}.yaml  the RBAC templates alone, rendered with every
#                                gate on (the agent's integration tests apply
#                                them as shipped, whichever gate they test)
#   deploy/initcontainer/policy.yaml  the init-container policy (gate initcontainer)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
helm="$repo/bin/helm"
chart=deploy/helm/inpod
cd "$repo"

render() { # out-dir
  local out=$1 header
  header="# Generated from $chart by \`make manifests\` (helm template, default values): edit the chart, not this file."
  mkdir -p "$out/manifests" "$out/rbac" "$out/controller" "$out/initcontainer"
  {
    echo "$header"
    printf -- '---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: inpod-system\n'
    "$helm" template inpod "$chart" -n inpod-system --no-hooks
  } >"$out/manifests/inpod.yaml"
  for c in agent plugin; do
    {
      echo "${header/default values/every gate on}"
      "$helm" template inpod "$chart" -n inpod-system --set 'gates={deviceplugin,dra,node-condition}' --show-only "templates/rbac-$c.yaml" | sed '1{/^---$/d}'
    } >"$out/rbac/$c.yaml"
  done
  for t in rbac deployment pdb node-taint-policy; do
    {
      echo "${header/default values/controller.enabled, controller.nodeTaintPolicy.enabled}"
      "$helm" template inpod "$chart" -n inpod-system --set 'gates={node-condition}' \
        --set controller.enabled=true --set controller.nodeTaintPolicy.enabled=true \
        --show-only "templates/controller-$t.yaml" | sed '1{/^---$/d}'
    } >"$out/controller/$t.yaml"
  done
  {
    echo "${header/default values/gates=initcontainer}"
    "$helm" template inpod "$chart" -n inpod-system --set 'gates={initcontainer}' \
      --show-only templates/admission-init-container.yaml | sed '1{/^---$/d}'
  } >"$out/initcontainer/policy.yaml"
}

if [ "${1:-}" = --check ]; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  render "$tmp"
  stale=0
  for f in manifests/inpod.yaml rbac/agent.yaml rbac/plugin.yaml controller/rbac.yaml controller/deployment.yaml controller/pdb.yaml controller/node-taint-policy.yaml initcontainer/policy.yaml; do
    if ! diff -u "deploy/$f" "$tmp/$f"; then stale=1; fi
  done
  if [ $stale = 1 ]; then
    echo "deploy/manifests, deploy/rbac, deploy/controller or deploy/initcontainer is out of date with the chart: run 'make manifests' and commit" >&2
    exit 1
  fi
else
  render deploy
fi
