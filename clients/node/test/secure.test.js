'use strict';
// Runs against a broker with TLS and credentials: AGENTMESH_SECURE_BROKER names it,
// AGENTMESH_TLS_CA and AGENTMESH_TOKEN are what a deployed Node agent would be given
// (tests/integration/test_node_client.py sets them). Skipped otherwise.

const test = require('node:test');
const assert = require('node:assert/strict');
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
