'use strict';
// The mesh the tests of test/mesh.test.js run against. AGENTMESH_BROKER and AGENTMESH_GATEWAY
// name a running one (tests/integration/test_node_client.py gives its own). Without them,
// `npm test` starts `agentmesh up` (the embedded mesh: a broker, a gateway and the sample
// agents, on free ports) for the run, with the repository's virtualenv (`make setup` makes
// it); AGENTMESH_PYTHON names another Python that has agentmesh installed.

const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { spawn } = require('node:child_process');

const ROOT = path.resolve(__dirname, '..', '..', '..');

/** How long `agentmesh up` may take to be ready (its agents start one by one). */
const READY_MS = 60000;

/**
 * The mesh's addresses, and stop() for a mesh started here (a no-op for one given): resolves
 * once it serves; rejects, saying why, when it cannot start.
 */
async function meshUp() {
  const { AGENTMESH_BROKER: broker, AGENTMESH_GATEWAY: gateway } = process.env;
  if (broker && gateway) return { broker, gateway, stop: async () => {} };
  const venv = path.join(ROOT, '.venv', 'bin', 'python');
  const python = process.env.AGENTMESH_PYTHON || (fs.existsSync(venv) ? venv : 'python3');
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'agentmesh-node-tests-'));
  const ready = path.join(dir, 'ready.json');
  // (Its traces, event log and reports go to a folder of its own, not the repository.)
  const child = spawn(python, ['-m', 'mesh', 'up', '--port', '0', '--gateway-port', '0',
    '--metrics-port', '-1', '--dashboard-port', '-1', '--ready-file', ready,
    '--reports-dir', path.join(dir, 'reports')], {
    cwd: dir,
    env: { ...process.env, PYTHONPATH: [ROOT, process.env.PYTHONPATH].filter(Boolean).join(':') },
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  let said = '';
  child.stderr.on('data', (chunk) => { said = (said + chunk).slice(-4000); });
  const exited = new Promise((resolve) => { child.once('exit', resolve); });
  const until = Date.now() + READY_MS;
  while (!fs.existsSync(ready) || !fs.statSync(ready).size) {
    if (child.exitCode !== null || Date.now() > until) {
      child.kill('SIGKILL');
      throw new Error(`agentmesh up (${python}) did not start: run \`make setup\` first, or `
        + `set AGENTMESH_BROKER and AGENTMESH_GATEWAY to a running mesh\n${said}`);
    }
    await new Promise((resolve) => { setTimeout(resolve, 100); });
  }
  const info = JSON.parse(fs.readFileSync(ready, 'utf8'));
  return {
    broker: info.broker,
    gateway: info.gateway,
    async stop() {
      child.kill('SIGTERM');
      await exited;
      fs.rmSync(dir, { recursive: true, force: true });
    },
  };
}

module.exports = { meshUp };
