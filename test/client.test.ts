import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { edgeClient, edgePool, startProxy, backends, eventually } from './helpers'

let proxy: Awaited<ReturnType<typeof startProxy>>
before(async () => (proxy = await startProxy()))
after(() => proxy.close())

test('connects through the proxy under every auth method', async () => {
  for (const role of ['trust_user', 'password_user', 'md5_user', 'scram_user'] as const) {
    const client = edgeClient(proxy.port, role)
    await client.connect()
    const { rows } = await client.query('SELECT current_user AS u, $1::int AS n', [42])
    assert.deepEqual(rows, [{ u: role, n: 42 }])
    await client.end()
  }
})

test('client.end() leaves no Postgres backend behind', async () => {
  const client = edgeClient(proxy.port, 'scram_user', { application_name: 'edgepg-end-test' })
  await client.connect()
  await client.query('SELECT 1') // a pipelined connect() resolves before the backend is ready
  assert.equal(await backends('edgepg-end-test'), 1)
  await client.end()
  await eventually(async () => (await backends('edgepg-end-test')) === 0, 'backend to exit')
})
