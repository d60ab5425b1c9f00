import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { edgeClient, edgePool, startProxy, backends, eventually } from './support/helpers'

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

test('client.end() leaves no Postgres backend behind: none without the pool; with it, one idle backend until the proxy closes', async () => {
  for (const enabled of [false, true]) {
    const app = `edgepg-end-test-${enabled}`
    const own = await startProxy({ pool: { enabled } })
    const client = edgeClient(own.port, 'scram_user', { application_name: app })
    await client.connect()
    await client.query('SELECT 1')
    assert.equal(await backends(app), 1)
    await client.end()
    if (enabled) {
      await eventually(async () => (await own.metrics.registry.getSingleMetric('edgepg_proxy_pool_idle_backends')!.get()).values[0].value === 1, 'the backend to be pooled')
      assert.equal(await backends(app), 1, 'kept, idle, for the next session')
    }
    await own.close()
    await eventually(async () => (await backends(app)) === 0, `pool ${enabled ? 'on' : 'off'}: the backend to exit`)
  }
})

test("forceDisablePgSSL (Neon's option) sets ssl aside: sslmode=require reaches a Postgres without TLS only with it", async () => {
  const withSsl = edgeClient(proxy.port, 'scram_user', { ssl: true })
  await assert.rejects(withSsl.connect(), 'without it, the proxy is asked for TLS that this Postgres does not offer')
  const client = edgeClient(proxy.port, 'scram_user', { ssl: true, forceDisablePgSSL: true })
  await client.connect()
  assert.deepEqual((await client.query('SELECT 1 AS one')).rows, [{ one: 1 }])
  await client.end()
})

test('the password stays out of sight, as in pg: not in util.inspect nor JSON.stringify of a Client', async () => {
  const { inspect } = await import('node:util')
  const { Client } = await import('../src/index')
  // (The third as pg-pool hands its clients their config: the password not enumerable.)
  const fromPool = Object.defineProperty({ user: 'u', host: 'h' }, 'password', { value: 'secret-pw-3', enumerable: false })
  for (const config of [{ user: 'u', password: 'secret-pw-1', host: 'h' }, 'postgresql://u:secret-pw-2@h/db', fromPool]) {
    const client = new Client(config as any)
    assert.match(String(client.password), /^secret-pw-\d$/, 'the client has its password')
    const shown = inspect(client, { depth: 4 }) + JSON.stringify(client)
    assert.ok(!/secret-pw-/.test(shown), `the password shows: ${shown.match(/.{40}secret-pw-.{10}/)?.[0]}`)
  }
})
