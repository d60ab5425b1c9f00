import { test } from 'node:test'
import assert from 'node:assert/strict'
import net from 'node:net'
import { closeOf, edgeClient, startProxy, tryUpgrade, backends, eventually } from './support/helpers'
import { SUBPROTOCOL } from '../src/config'

// Limits on what the proxy accepts, and how it ends sessions: all with clear HTTP statuses or
// WebSocket close codes that name the reason.

test('max sessions: the next upgrade is refused with 503 and the reason', async () => {
  const proxy = await startProxy({ maxSessions: 2 })
  try {
    const a = await tryUpgrade(proxy.url)
    const b = await tryUpgrade(proxy.url)
    assert.deepEqual([a.status, b.status], [101, 101])
    const c = await tryUpgrade(proxy.url)
    assert.equal(c.status, 503)
    assert.match(c.body, /too many sessions \(2\)/)
    a.ws!.close()
    await eventually(() => proxy.sessionCount === 1, 'the closed session to be released')
    const d = await tryUpgrade(proxy.url)
    assert.equal(d.status, 101, 'a freed slot is usable again')
    b.ws!.close()
    d.ws!.close()
  } finally {
    await proxy.close()
  }
})

test('max sessions per client address: 429', async () => {
  const proxy = await startProxy({ maxSessionsPerIp: 1 })
  try {
    const a = await tryUpgrade(proxy.url)
    const b = await tryUpgrade(proxy.url)
    assert.equal(b.status, 429)
    assert.match(b.body, /too many sessions from 127\.0\.0\.1 \(1\)/)
    a.ws!.close()
  } finally {
    await proxy.close()
  }
})

test('browser Origins: refused unless allowed; requests without Origin are fine', async () => {
  const strict = await startProxy()
  const open = await startProxy({ allowedOrigins: ['https://app.example'] })
  const any = await startProxy({ allowedOrigins: ['*'] })
  try {
    const refused = await tryUpgrade(strict.url, { headers: { origin: 'https://evil.example' } })
    assert.equal(refused.status, 403)
    assert.match(refused.body, /origin https:\/\/evil\.example is not allowed/)
    assert.equal((await tryUpgrade(open.url, { headers: { origin: 'https://evil.example' } })).status, 403)
    const allowed = await tryUpgrade(open.url, { headers: { origin: 'https://app.example' } })
    const wildcard = await tryUpgrade(any.url, { headers: { origin: 'https://anything.example' } })
    const noOrigin = await tryUpgrade(strict.url)
    assert.deepEqual([allowed.status, wildcard.status, noOrigin.status], [101, 101, 101])
    for (const r of [allowed, wildcard, noOrigin]) r.ws!.close()
  } finally {
    await Promise.all([strict.close(), open.close(), any.close()])
  }
})

test('handshake timeout: a stalled upgrade is dropped; a session that never finishes its startup is closed (1008)', async () => {
  const proxy = await startProxy({ handshakeTimeoutMs: 300 })
  try {
    const raw = net.connect(proxy.port, '127.0.0.1')
    raw.write('GET /v2 HTTP/1.1\r\nHost: x\r\n') // never finished
    const dropped = new Promise((resolve) => raw.once('close', resolve))
    const { ws } = await tryUpgrade(proxy.url, { protocols: [SUBPROTOCOL] })
    ws!.send(Buffer.from([0, 0, 0, 40])) // the start of a startup packet, then nothing
    const started = Date.now()
    const { code, reason } = await closeOf(ws!)
    assert.equal(code, 1008)
    assert.match(reason, /startup not finished in time/)
    await dropped
    assert.ok(Date.now() - started < 2000, 'closed promptly after the timeout')
    // A client that completes its startup in time is not affected.
    const client = edgeClient(proxy.port)
    await client.connect()
    await new Promise((r) => setTimeout(r, 500))
    assert.deepEqual((await client.query('SELECT 1 AS x')).rows, [{ x: 1 }])
    await client.end()
  } finally {
    await proxy.close()
  }
})

test('idle timeout: a session with no traffic is closed; traffic keeps it open', async () => {
  const proxy = await startProxy({ idleTimeoutMs: 600, pool: { enabled: false } }) // (a pooled backend would outlive its session)
  try {
    const busy = edgeClient(proxy.port)
    busy.on('error', () => {}) // once the checks below are done it idles too, and is closed in its turn
    const idle = edgeClient(proxy.port, 'scram_user', { application_name: 'edgepg-idle' })
    const idleErrors: Error[] = []
    idle.on('error', (e) => idleErrors.push(e))
    await Promise.all([busy.connect(), idle.connect()])
    await idle.query('SELECT 1')
    for (let i = 0; i < 8; i++) {
      await busy.query('SELECT 1')
      await new Promise((r) => setTimeout(r, 150))
    }
    assert.deepEqual((await busy.query('SELECT 2 AS two')).rows, [{ two: 2 }], 'the busy session outlived the timeout')
    await eventually(() => idleErrors.length > 0, 'the idle session to be closed')
    assert.match(idleErrors[0].message, /code 1001: edgepg-proxy: idle timeout/)
    await eventually(async () => (await backends('edgepg-idle')) === 0, "the idle session's backend to exit")
    await busy.end()
  } finally {
    await proxy.close()
  }
})

test('graceful shutdown: new sessions refused, running ones may finish, the rest closed with 1001 and a clear error', async () => {
  const proxy = await startProxy()
  const finishing = edgeClient(proxy.port)
  const lingering = edgeClient(proxy.port, 'scram_user', { application_name: 'edgepg-linger' })
  await Promise.all([finishing.connect(), lingering.connect()])
  await lingering.query('SELECT 1')
  const lingeringErrors: Error[] = []
  lingering.on('error', (e) => lingeringErrors.push(e))
  const query = finishing.query('SELECT pg_sleep(0.3), 42 AS answer')
  const closing = proxy.close(1500)
  await new Promise((r) => setTimeout(r, 50))
  const refused = await tryUpgrade(proxy.url).catch((e) => ({ status: 0, body: String(e) }))
  assert.ok(refused.status === 503 || /ECONNREFUSED/.test(refused.body), `new sessions are refused while shutting down: ${refused.status} ${refused.body}`)
  assert.deepEqual((await query).rows[0].answer, 42, 'the running query finished')
  await finishing.end() // ends by itself within the grace period
  await closing
  assert.match(lingeringErrors[0]?.message ?? '', /was closed \(code 1001: edgepg-proxy is shutting down\)/)
  await eventually(async () => (await backends('edgepg-linger')) === 0, 'the cut session to leave no backend')
})

test('an allow-listed host name is pinned to the addresses it had: re-pointed elsewhere, it is refused', async () => {
  const { port } = (await import('./support/helpers')).testPostgres()
  let answer = ['127.0.0.1']
  const proxy = await startProxy({ allow: [`db.internal:${port}`], lookup: async () => answer })
  try {
    const via = `ws://127.0.0.1:${proxy.port}/v1?address=db.internal:${port}`
    const client = edgeClient(proxy.port, 'scram_user', { wsProxy: () => via })
    await client.connect()
    assert.deepEqual((await client.query('SELECT 1 AS one')).rows, [{ one: 1 }], 'relayed to the address the name had')
    await client.end()
    answer = ['127.0.0.2'] // DNS now points the name somewhere the allow-list never had
    const refused = await tryUpgrade(via)
    assert.equal(refused.status, 403)
    assert.match(refused.body, /no longer resolves to an address the allow-list had/)
  } finally {
    await proxy.close()
  }
})

test('a client past its session limit is refused before the name it asks for is looked up; a refusal after the lookup gives its place back', async () => {
  const { port } = (await import('./support/helpers')).testPostgres()
  let answer = ['127.0.0.1']
  let lookups = 0
  const proxy = await startProxy({ allow: [`db.internal:${port}`], lookup: async () => (lookups++, answer), maxSessionsPerIp: 1 })
  try {
    const via = `ws://127.0.0.1:${proxy.port}/v1?address=db.internal:${port}`
    const held = edgeClient(proxy.port, 'scram_user', { wsProxy: () => via })
    held.on('error', () => {}) // (closed by the proxy's close, should an assertion fail)
    await held.connect() // (its one place)
    const before = lookups
    assert.equal((await tryUpgrade(via)).status, 429)
    assert.equal(lookups, before, 'no lookup for a client past its limit')
    await held.end()
    await eventually(() => proxy.sessionCount === 0, 'the place free again')
    answer = ['127.0.0.2'] // the name now points where the allow-list never had it
    for (let i = 0; i < 3; i++) assert.equal((await tryUpgrade(via)).status, 403, `refusal ${i + 1} after the lookup, not 429: each gave its place back`)
  } finally {
    await proxy.close()
  }
})
