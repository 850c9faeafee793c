'use strict';
// Runs against a broker with TLS and credentials: AGENTMESH_SECURE_BROKER names it,
// AGENTMESH_TLS_CA and AGENTMESH_TOKEN are what a deployed Node agent would be given, and
// AGENTMESH_SECURE_CREDENTIALS the broker's credentials file, which the last test rewrites
// (tests/integration/test_node_client.py sets them). Skipped otherwise.

const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { MeshClient } = require('../lib/mesh');

const BROKER = process.env.AGENTMESH_SECURE_BROKER;
const skip = BROKER ? false : 'AGENTMESH_SECURE_BROKER is not set';

test('talks TLS with a bearer token, and acts only as its own agent', { skip }, async () => {
  const client = new MeshClient(BROKER, { agentId: 'NodePaymentAgent' });
  try {
    await client.register({ agentTypes: ['payment'] });
    const sent = await client.send('NodePaymentAgent', { action: 'note' });
    const got = await client.receive('NodePaymentAgent');
    assert.deepEqual(got.map((m) => m.messageId), [sent.messageId]);
    await assert.rejects(client.send('NodePaymentAgent', { action: 'x' }, { from: 'Other' }),
      (err) => err.codeName === 'PERMISSION_DENIED');
    await assert.rejects(client.register({ agentId: 'Other' }),
      (err) => err.codeName === 'PERMISSION_DENIED');
  } finally {
    client.close();
  }
});

test('is refused without a credential', { skip }, async () => {
  const client = new MeshClient(BROKER, { agentId: 'NodePaymentAgent', token: '' });
  try {
    await assert.rejects(client.listAgents(), (err) => err.codeName === 'UNAUTHENTICATED');
  } finally {
    client.close();
  }
});

test('is refused over plaintext by a TLS broker', { skip }, async () => {
  const client = new MeshClient(BROKER, { agentId: 'NodePaymentAgent', tlsCa: '' });
  try {
    await assert.rejects(client.listAgents(), (err) => err.codeName === 'UNAVAILABLE');
  } finally {
    client.close();
  }
});

/** Runs check until it passes, every 200 ms for 10 s at most (what a server looks at). */
async function eventually(check) {
  const until = Date.now() + 10000;
  for (;;) {
    try {
      return await check();
    } catch (err) {
      if (Date.now() > until) throw err;
      await new Promise((resolve) => { setTimeout(resolve, 200); });
    }
  }
}

test('reads its token file again: a rotated token goes on, a revoked one is refused',
  { skip: skip || (process.env.AGENTMESH_SECURE_CREDENTIALS ? false : 'no credentials file') },
  async () => {
    // Last: it rotates the token the tests above use, in the broker's credentials file.
    const credentials = process.env.AGENTMESH_SECURE_CREDENTIALS;
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'agentmesh-token-'));
    const tokenFile = path.join(dir, 'token');
    const old = process.env.AGENTMESH_TOKEN;
    const rotated = 'node-payment-token-rotated-0123';
    fs.writeFileSync(tokenFile, `${old}\n`);
    const client = new MeshClient(BROKER, { agentId: 'NodePaymentAgent', tokenFile });
    const revoked = new MeshClient(BROKER, { agentId: 'NodePaymentAgent', token: old });
    const principal = (token) => ({ name: 'node', token, agents: ['NodePaymentAgent'] });
    try {
      await client.send('NodePaymentAgent', { action: 'before' }); // (its session opens)
      fs.writeFileSync(credentials, JSON.stringify(
        { principals: [principal(old), principal(rotated)] }));
      fs.writeFileSync(tokenFile, rotated);
      await new Promise((resolve) => { setTimeout(resolve, 2500); }); // (looked at every 1 s)
      fs.writeFileSync(credentials, JSON.stringify({ principals: [principal(rotated)] }));
      await eventually(() => assert.rejects(revoked.listAgents(),
        (err) => err.codeName === 'UNAUTHENTICATED'));
      await client.send('NodePaymentAgent', { action: 'after' }); // (a session opened again)
      const got = await client.receive('NodePaymentAgent');
      assert.deepEqual(got.map((m) => m.content.action).sort(), ['after', 'before']);

      fs.writeFileSync(tokenFile, '\n'); // (emptied): the token before stays
      await new Promise((resolve) => { setTimeout(resolve, 2500); });
      assert.deepEqual(await client.listAgents().then((agents) => agents.length), 1);
    } finally {
      client.close();
      revoked.close();
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });
