/**
 * Observability of edgepg-proxy: Prometheus metrics (proxy/admin/metrics.ts), GET /healthz
 * (proxy/admin/health.ts) and the one-line-per-session log.
 *
 * - "metrics (unit)" and "healthHandler (unit)" drive createMetrics() / healthHandler() directly,
 *   each behind a throwaway HTTP server of this file's own.
 * - "proxy: /healthz and /metrics" expects them wired into createProxy (proxy/index.ts): both
 *   routes on the proxy's own HTTP server (the WebSocket port), `proxy.metrics` exposed, and the
 *   counters fed by real sessions made with the edgepg Client and by refused upgrades.
 * - "session log" checks the log entries themselves: every field there, and never a password or
 *   any part of a query's text or parameters.
 */
import { test, describe } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import net from 'node:net'
import { randomUUID } from 'node:crypto'
import { WebSocket } from 'ws'
import { register as globalRegistry } from 'prom-client'
import { createProxy, type ProxyOptions, type SessionLog } from '../proxy/index'
import { createMetrics, REFUSAL_REASONS, OUTCOME_KINDS, type Metrics, type RefusalReason } from '../proxy/admin/metrics'
import type { OutcomeKind } from '../proxy/ws/session'
import { healthHandler } from '../proxy/admin/health'
import { parseConfig } from '../proxy/config'
import { Client } from '../src/index'
import { neonConfig, Client as NeonClient } from '@neondatabase/serverless'
import { PASSWORD, freePort, type Role } from './support/stack'
import { edgeConfig, testPostgres, eventually, within } from './support/helpers'
import { startChildProxy } from './support/child-proxy'

const PG = testPostgres()
const UPSTREAM = `${PG.host}:${PG.port}`
const P = 'edgepg_proxy_'

// ---------------------------------------------------------------------------------------------
// Helpers

interface Reply {
  status: number
  type: string
  body: string
}

/** A plain HTTP request (not fetch: it keeps no connection open). */
function request(url: string, method = 'GET'): Promise<Reply> {
  return within(5000, `${method} ${url}`, new Promise((resolve, reject) => {
    const req = http.request(url, { method, agent: false }, (res) => {
      let body = ''
      res.setEncoding('utf8')
      res.on('data', (c: string) => (body += c))
      res.on('end', () => resolve({ status: res.statusCode ?? 0, type: String(res.headers['content-type'] ?? ''), body }))
    })
    req.on('error', reject)
    req.end()
  }))
}

/** A throwaway HTTP server on loopback with one handler for every request. */
async function serve(handler: (req: http.IncomingMessage, res: http.ServerResponse) => void | Promise<void>) {
  const server = http.createServer((req, res) => void handler(req, res))
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const { port } = server.address() as net.AddressInfo
  return {
    url: `http://127.0.0.1:${port}`,
    close: () => {
      server.closeAllConnections()
      return new Promise<void>((resolve) => server.close(() => resolve()))
    },
  }
}

async function withServer<T>(handler: Parameters<typeof serve>[0], fn: (url: string) => Promise<T>): Promise<T> {
  const s = await serve(handler)
  try {
    return await fn(s.url)
  } finally {
    await s.close()
  }
}

interface Sample {
  name: string
  labels: Record<string, string>
  value: number
}

/** Parses the Prometheus text exposition format into samples. */
function parseExposition(text: string): Sample[] {
  const samples: Sample[] = []
  for (const line of text.split('\n')) {
    if (!line || line.startsWith('#')) continue
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line)
    if (!m) throw new Error(`unparseable exposition line: ${line}`)
    const labels: Record<string, string> = {}
    for (const l of (m[2] ?? '').matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2]
    samples.push({ name: m[1], labels, value: m[3] === '+Inf' ? Infinity : Number(m[3]) })
  }
  return samples
}

/** The value of the sample `name` with exactly these labels, or undefined when absent. */
function sample(text: string, name: string, labels: Record<string, string> = {}): number | undefined {
  const want = JSON.stringify(Object.entries(labels).sort())
  return parseExposition(text).find((s) => s.name === name && JSON.stringify(Object.entries(s.labels).sort()) === want)?.value
}

/** Like `sample`, but the series must exist. */
function value(text: string, name: string, labels: Record<string, string> = {}): number {
  const v = sample(text, name, labels)
  assert.ok(v !== undefined, `no sample ${name}${JSON.stringify(labels)} in the exposition:\n${text.split('\n').filter((l) => l.includes(P)).join('\n')}`)
  return v
}

/** A proxy in this process relaying to the test Postgres, recording its session log. */
async function startLocalProxy(options: Partial<ProxyOptions> = {}) {
  const logs: SessionLog[] = []
  const proxy = createProxy({ upstream: UPSTREAM, log: (entry) => logs.push(entry), ...options })
  const { port } = await proxy.listen(0, '127.0.0.1')
  return {
    ...proxy,
    port,
    logs,
    http: `http://127.0.0.1:${port}`,
    ws: (path: string) => `ws://127.0.0.1:${port}${path}`,
    /** `proxy.metrics`, once index.ts exposes it. */
    metrics: (proxy as unknown as { metrics?: Metrics }).metrics,
    /** GET /metrics on the proxy's own port; fails unless it is served there. */
    async scrape(): Promise<string> {
      const r = await request(`http://127.0.0.1:${port}/metrics`)
      assert.equal(r.status, 200, `GET /metrics on the proxy's port answered ${r.status} (${r.body.trim()}): proxy/index.ts must route it to metrics.handle`)
      return r.body
    },
  }
}
type LocalProxy = Awaited<ReturnType<typeof startLocalProxy>>

async function withProxy<T>(options: Partial<ProxyOptions>, fn: (p: LocalProxy) => Promise<T>): Promise<T> {
  const p = await startLocalProxy(options)
  try {
    return await fn(p)
  } finally {
    await p.close()
  }
}

const edgeClient = (port: number, role: Role = 'scram_user', extra: Record<string, unknown> = {}) => new Client(edgeConfig(port, role, extra))

/** Connects, runs `sql` with `params`, and ends; returns the rows. */
async function session(port: number, sql = 'SELECT 1 AS one', params: unknown[] = [], role: Role = 'scram_user') {
  const client = edgeClient(port, role)
  await within(10000, 'connect through the proxy', client.connect())
  try {
    return (await client.query(sql, params)).rows
  } finally {
    await client.end()
  }
}

/**
 * A session as password_user with a wrong password. The connect is pipelined by default, so
 * connect() may resolve and the first query carry Postgres's 28P01.
 */
async function wrongPassword(port: number, password: string) {
  const client = edgeClient(port, 'password_user', { password })
  await within(10000, 'a refused connect', assert.rejects(client.connect().then(() => client.query('SELECT 1')), (err: any) => err.code === '28P01'))
  await within(5000, 'end after the refusal', client.end().catch(() => {}))
}

/** HTTP status of a WebSocket upgrade attempt (101 when it opened; then it is closed). */
function upgradeStatus(url: string, headers?: Record<string, string>): Promise<number> {
  return within(5000, `upgrade ${url}`, new Promise((resolve, reject) => {
    const ws = new WebSocket(url, { headers })
    ws.once('open', () => {
      ws.close()
      resolve(101)
    })
    ws.once('unexpected-response', (req, res) => {
      res.resume()
      req.destroy()
      resolve(res.statusCode ?? 0)
    })
    ws.once('error', reject)
  }))
}

const logOf = (kind: OutcomeKind, authFailed: boolean, bytesIn = 0, bytesOut = 0): SessionLog => ({ peer: '127.0.0.1', upstream: UPSTREAM, durationMs: 1, bytesIn, bytesOut, outcome: kind, kind, authFailed })

// ---------------------------------------------------------------------------------------------

describe('metrics (unit)', () => {
  test('exposition: sessions, bytes, auth failures, connect latency, refusals, default process metrics', async () => {
    const m = createMetrics()
    m.sessionOpened()
    m.sessionOpened()
    m.sessionOpened()
    m.sessionClosed(logOf('ok', false, 120, 3400))
    m.sessionClosed(logOf('refused_by_postgres', true, 40, 90))
    m.upstreamConnected(0.0007)
    m.upstreamConnected(0.2)
    m.refused('forbidden_address')
    m.refused('not_found')
    m.refused('not_found')
    m.refused('no-such-reason' as RefusalReason)

    await withServer((req, res) => m.handle(req, res), async (url) => {
      const r = await request(`${url}/metrics`)
      assert.equal(r.status, 200, `status ${r.status}`)
      assert.match(r.type, /^text\/plain; version=0\.0\.4/)
      const t = r.body
      assert.equal(value(t, `${P}sessions_active`), 1)
      assert.equal(value(t, `${P}sessions_total`, { outcome_kind: 'ok' }), 1)
      assert.equal(value(t, `${P}sessions_total`, { outcome_kind: 'refused_by_postgres' }), 1)
      for (const kind of OUTCOME_KINDS) assert.ok(sample(t, `${P}sessions_total`, { outcome_kind: kind }) !== undefined, `series for outcome_kind="${kind}" exists from the start`)
      assert.equal(value(t, `${P}bytes_received_total`), 160)
      assert.equal(value(t, `${P}bytes_sent_total`), 3490)
      assert.equal(value(t, `${P}auth_failures_total`), 1)

      assert.equal(value(t, `${P}upstream_connect_seconds_count`), 2)
      assert.ok(Math.abs(value(t, `${P}upstream_connect_seconds_sum`) - 0.2007) < 1e-9, 'histogram sum')
      assert.equal(value(t, `${P}upstream_connect_seconds_bucket`, { le: '0.0005' }), 0)
      assert.equal(value(t, `${P}upstream_connect_seconds_bucket`, { le: '0.001' }), 1)
      assert.equal(value(t, `${P}upstream_connect_seconds_bucket`, { le: '0.25' }), 2)
      assert.equal(value(t, `${P}upstream_connect_seconds_bucket`, { le: '5' }), 2)
      assert.equal(value(t, `${P}upstream_connect_seconds_bucket`, { le: '+Inf' }), 2)

      assert.equal(value(t, `${P}upgrades_refused_total`, { reason: 'forbidden_address' }), 1)
      assert.equal(value(t, `${P}upgrades_refused_total`, { reason: 'not_found' }), 2)
      assert.equal(value(t, `${P}upgrades_refused_total`, { reason: 'other' }), 1, 'an unknown reason counts as "other"')
      assert.equal(sample(t, `${P}upgrades_refused_total`, { reason: 'no-such-reason' }), undefined, 'no series for an unlisted reason')
      for (const reason of REFUSAL_REASONS) assert.ok(sample(t, `${P}upgrades_refused_total`, { reason }) !== undefined, `series for reason="${reason}" exists from the start`)
      assert.equal(value(t, `${P}upgrades_refused_total`, { reason: 'too_many_sessions_per_ip' }), 0)

      // prom-client's default process metrics, on this registry.
      for (const name of ['process_cpu_user_seconds_total', 'process_resident_memory_bytes', 'nodejs_heap_size_used_bytes', 'nodejs_eventloop_lag_seconds']) {
        assert.ok(sample(t, name) !== undefined, `default metric ${name} is exposed`)
      }

      const head = await request(`${url}/metrics`, 'HEAD')
      assert.equal(head.status, 200, `HEAD status ${head.status}`)
      assert.equal(head.body, '', 'HEAD has no body')
      assert.equal((await request(`${url}/metrics`, 'POST')).status, 405)
    })
  })

  test('each createMetrics() has its own registry: several proxies in one process never clash, the global registry stays empty', async () => {
    const a = createMetrics()
    const b = createMetrics()
    a.sessionOpened()
    a.sessionClosed(logOf('ok', false, 10, 20))
    a.refused('origin')
    const ta = await a.registry.metrics()
    const tb = await b.registry.metrics()
    assert.equal(value(ta, `${P}sessions_total`, { outcome_kind: 'ok' }), 1)
    assert.equal(value(tb, `${P}sessions_total`, { outcome_kind: 'ok' }), 0)
    assert.equal(value(ta, `${P}upgrades_refused_total`, { reason: 'origin' }), 1)
    assert.equal(value(tb, `${P}upgrades_refused_total`, { reason: 'origin' }), 0)
    assert.equal(value(tb, `${P}bytes_received_total`), 0)
    assert.equal(globalRegistry.getSingleMetric(`${P}sessions_total`), undefined, 'nothing registered on prom-client\'s global registry')
  })
})

describe('healthHandler (unit)', () => {
  test('200 with the upstream and latency when Postgres is reachable', async () => {
    await withServer(healthHandler({ host: PG.host, port: PG.port }), async (url) => {
      const r = await request(`${url}/healthz`)
      assert.equal(r.status, 200, `status ${r.status}: ${r.body}`)
      assert.match(r.type, /^application\/json/)
      const body = JSON.parse(r.body)
      assert.equal(body.status, 'ok')
      assert.equal(body.upstream, UPSTREAM)
      assert.ok(typeof body.latencyMs === 'number' && body.latencyMs >= 0 && body.latencyMs < 2000, `latencyMs ${body.latencyMs}`)
      assert.equal(body.error, undefined)
      assert.equal((await request(`${url}/healthz`, 'POST')).status, 405)
    })
  })

  test('503 with the error code when nothing listens upstream', async () => {
    const port = await freePort()
    await withServer(healthHandler({ host: '127.0.0.1', port }), async (url) => {
      const r = await request(`${url}/healthz`)
      assert.equal(r.status, 503, `status ${r.status}: ${r.body}`)
      assert.match(r.type, /^application\/json/)
      const body = JSON.parse(r.body)
      assert.equal(body.status, 'unavailable')
      assert.equal(body.upstream, `127.0.0.1:${port}`)
      assert.equal(body.error, 'ECONNREFUSED')
    })
  })

  test('an upstream that never answers: 503 ETIMEDOUT after timeoutMs, not later', async () => {
    // A connection that never completes (a black-holed address), stood in for by a socket that
    // is never connected: net.connect to BLACKHOLE is intercepted for the length of this test.
    const BLACKHOLE = await freePort()
    const mod = net as any
    const original = mod.connect
    mod.connect = function (this: unknown, ...args: any[]) {
      return args[0]?.port === BLACKHOLE ? new net.Socket() : original.apply(this, args)
    }
    try {
      await withServer(healthHandler({ host: '127.0.0.1', port: BLACKHOLE }, { timeoutMs: 300 }), async (url) => {
        const started = Date.now()
        const r = await request(`${url}/healthz`)
        const elapsed = Date.now() - started
        assert.equal(r.status, 503, `status ${r.status}: ${r.body}`)
        assert.equal(JSON.parse(r.body).error, 'ETIMEDOUT')
        assert.ok(elapsed >= 250 && elapsed < 1500, `answered after ${elapsed} ms with timeoutMs 300`)
      })
    } finally {
      mod.connect = original
    }
  })
})

test('healthHandler: a flood of /healthz probes Postgres at most once a second, and a later request probes afresh', async () => {
  // A TCP listener standing in for Postgres, counting the connections it gets.
  let connections = 0
  const upstream = net.createServer((socket) => (connections++, socket.destroy()))
  await new Promise<void>((r) => upstream.listen(0, '127.0.0.1', () => r()))
  const port = (upstream.address() as net.AddressInfo).port
  try {
    await withServer(healthHandler({ host: '127.0.0.1', port }, { timeoutMs: 2000, probeEveryMs: 1000 }), async (url) => {
      const answers = await Promise.all(Array.from({ length: 300 }, () => request(`${url}/healthz`)))
      assert.ok(answers.every((r) => r.status === 200), 'every request answered 200')
      assert.equal(connections, 1, '300 requests at once: one probe')
      await new Promise((r) => setTimeout(r, 1100))
      assert.equal((await request(`${url}/healthz`)).status, 200)
      assert.equal(connections, 2, 'a request a second later: a new probe')
    })
  } finally {
    upstream.close()
  }
})

describe('proxy: /healthz and /metrics (need the wiring in proxy/index.ts)', () => {
  test('GET /healthz on the WebSocket port: 200 when Postgres is reachable, 503 ECONNREFUSED when not', async () => {
    await withProxy({}, async (p) => {
      const r = await request(`${p.http}/healthz`)
      assert.equal(r.status, 200, `GET /healthz answered ${r.status} (${r.body.trim()}): proxy/index.ts must route it to healthHandler(upstream)`)
      const body = JSON.parse(r.body)
      assert.equal(body.status, 'ok')
      assert.equal(body.upstream, undefined, 'the public listener names no upstream')
      assert.equal(await upgradeStatus(p.ws('/v2')), 101, 'WebSockets still served on the same port')
    })
    const closedPort = await freePort()
    await withProxy({ upstream: `127.0.0.1:${closedPort}` }, async (p) => {
      const r = await request(`${p.http}/healthz`)
      assert.equal(r.status, 503, `status ${r.status}: ${r.body}`)
      const body = JSON.parse(r.body)
      assert.equal(body.status, 'unavailable')
      assert.equal(body.error, 'ECONNREFUSED')
    })
  })

  test('GET /metrics on the WebSocket port serves this proxy\'s registry, also exposed as proxy.metrics', async () => {
    await withProxy({}, async (p) => {
      const r = await request(`${p.http}/metrics`)
      assert.equal(r.status, 200, `GET /metrics answered ${r.status} (${r.body.trim()}): proxy/index.ts must route it to metrics.handle`)
      assert.match(r.type, /^text\/plain; version=0\.0\.4/)
      assert.equal(value(r.body, `${P}sessions_active`), 0)
      assert.equal(value(r.body, `${P}sessions_total`, { outcome_kind: 'ok' }), 0)
      assert.ok(sample(r.body, 'process_resident_memory_bytes') !== undefined, 'default process metrics are served')
      assert.ok(p.metrics && typeof p.metrics.handle === 'function' && typeof p.metrics.sessionClosed === 'function', 'createProxy(...).metrics is the proxy\'s Metrics object')
      assert.ok(p.metrics.registry.getSingleMetric(`${P}sessions_total`), 'proxy.metrics.registry holds the proxy\'s metrics')
    })
  })

  test('the public listener names no role, database or upstream to another machine: /metrics only to this one (not through a forwarder), /healthz without the upstream', async () => {
    const get = (port: number, path: string, headers: Record<string, string> = {}) =>
      new Promise<Reply>((resolve, reject) => {
        http.get(`http://127.0.0.1:${port}${path}`, { headers, agent: false }, (res) => {
          let body = ''
          res.setEncoding('utf8').on('data', (c: string) => (body += c)).on('end', () => resolve({ status: res.statusCode ?? 0, type: '', body }))
        }).on('error', reject)
      })
    // Behind a trusted balancer, a remote client; without one, a request a forwarder on this machine passed on.
    for (const [trustProxy, headers] of [[['127.0.0.1'], { 'x-forwarded-for': '203.0.113.5' }], [undefined, { 'x-forwarded-for': '203.0.113.5' }], [undefined, { forwarded: 'for=203.0.113.5' }]] as const) {
      await withProxy({ trustProxy: trustProxy as string[] | undefined }, async (p) => {
        const c = edgeClient(p.port) // (a pool key in the metrics: its user and database)
        await c.connect()
        await c.query('SELECT 1')
        const local = await request(`${p.http}/metrics`)
        assert.equal(local.status, 200, 'served to this machine')
        assert.match(local.body, /user="scram_user"/)
        const remote = await get(p.port, '/metrics', headers)
        assert.equal(remote.status, 403, `${JSON.stringify(headers)}: ${remote.status}`)
        assert.match(remote.body, /served to this machine only; serve it elsewhere with --admin-listen/)
        for (const { body } of [remote, await get(p.port, '/healthz', headers)]) {
          for (const secret of ['scram_user', PG.database, UPSTREAM]) assert.ok(!body.includes(secret), `${secret} in ${body}`)
        }
        await c.end()
      })
    }
  })

  test('adminApart: /metrics and /healthz only on the admin listener (--admin-listen), not on the public one', async () => {
    const config = parseConfig(['--upstream', UPSTREAM, '--admin-listen', '9464'], {})
    assert.ok(config !== 'help')
    assert.deepEqual([config.adminListen, config.options.adminApart], [{ host: '127.0.0.1', port: 9464 }, true])
    await withProxy({ adminApart: true }, async (p) => {
      for (const path of ['/metrics', '/healthz']) assert.notEqual((await request(`${p.http}${path}`)).status, 200, `${path} is not served on the public listener`)
      const admin = await new Promise<number>((resolve) => p.admin.listen(0, '127.0.0.1', () => resolve((p.admin.address() as net.AddressInfo).port)))
      const metrics = await request(`http://127.0.0.1:${admin}/metrics`)
      assert.equal(metrics.status, 200)
      assert.equal(value(metrics.body, `${P}sessions_active`), 0)
      const health = await request(`http://127.0.0.1:${admin}/healthz`)
      assert.equal(health.status, 200, health.body)
      assert.deepEqual([JSON.parse(health.body).status, JSON.parse(health.body).upstream], ['ok', UPSTREAM], 'the admin listener names the upstream')
      assert.equal((await request(`http://127.0.0.1:${admin}/sql`, 'POST')).status, 404, 'nothing else on the admin listener')
      assert.equal(await upgradeStatus(p.ws('/v2')), 101, 'WebSockets still served on the public one')
      // Shutting down: a session still open holds the drain, and /healthz says so (a balancer sends no one new).
      const held = edgeClient(p.port)
      await held.connect()
      const closed = p.close(5000)
      const draining = await request(`http://127.0.0.1:${admin}/healthz`)
      assert.deepEqual([draining.status, JSON.parse(draining.body).status], [503, 'draining'])
      await held.end()
      await closed
    })
  })

  test('sessions through the edgepg Client: sessions_total, sessions_active, bytes equal the log\'s sums, upstream connect latency', async () => {
    await withProxy({ pool: { mode: 'session' } }, async (p) => { // (one upstream connect per session)
      const held = edgeClient(p.port)
      await within(10000, 'connect', held.connect())
      try {
        await held.query('SELECT 1')
        assert.equal(value(await p.scrape(), `${P}sessions_active`), 1, 'one session open')
        await session(p.port, 'SELECT repeat($1::text, 5000) AS s', ['y'])
      } finally {
        await held.end()
      }
      await session(p.port, 'SELECT 2', [], 'md5_user')
      await eventually(() => p.logs.length === 3, 'three session log entries')
      const t = await p.scrape()
      const sum = (f: (l: SessionLog) => number) => p.logs.reduce((s, l) => s + f(l), 0)
      const outcomes = p.logs.map((l) => l.outcome).join(' | ')
      assert.equal(value(t, `${P}sessions_total`, { outcome_kind: 'ok' }), 3, `outcomes: ${outcomes}`)
      assert.equal(value(t, `${P}sessions_active`), 0)
      assert.ok(sum((l) => l.bytesOut) > 5000, `bytesOut ${sum((l) => l.bytesOut)}`)
      assert.equal(value(t, `${P}bytes_received_total`), sum((l) => l.bytesIn), 'bytes_received_total = Σ bytesIn of the log')
      assert.equal(value(t, `${P}bytes_sent_total`), sum((l) => l.bytesOut), 'bytes_sent_total = Σ bytesOut of the log')
      assert.equal(value(t, `${P}upstream_connect_seconds_count`), 3, 'one upstream connect observed per session')
      const seconds = value(t, `${P}upstream_connect_seconds_sum`)
      assert.ok(seconds > 0 && seconds < 3, `upstream_connect_seconds_sum ${seconds}`)
      assert.equal(value(t, `${P}auth_failures_total`), 0)
    })
  })

  test('a wrong password counts as an auth failure (Postgres\'s 28P01 seen through auth offload)', async () => {
    await withProxy({}, async (p) => {
      const wrong = `wrong-${randomUUID()}`
      await wrongPassword(p.port, wrong)
      await eventually(() => p.logs.length === 1, 'the session log entry')
      assert.match(p.logs[0].outcome, /^refused by Postgres: 28P01/)
      const t = await p.scrape()
      assert.equal(value(t, `${P}auth_failures_total`), 1)
      assert.equal(value(t, `${P}sessions_total`, { outcome_kind: 'refused_by_postgres' }), 1)
      assert.equal(value(t, `${P}sessions_total`, { outcome_kind: 'ok' }), 0)
      assert.equal(value(t, `${P}sessions_active`), 0)
      assert.ok(!t.includes(wrong) && !t.includes(PASSWORD), 'no password in the metrics')
    })
  })

  test('refused upgrades are counted by reason: forbidden_address, not_found, bad_address', async () => {
    await withProxy({}, async (p) => {
      assert.equal(await upgradeStatus(p.ws('/v1?address=127.0.0.1:1')), 403)
      assert.equal(await upgradeStatus(p.ws('/nope')), 404)
      assert.equal(await upgradeStatus(p.ws('/v2/extra')), 404)
      assert.equal(await upgradeStatus(p.ws('/v1?address=a:b:c')), 400)
      const t = await p.scrape()
      assert.equal(value(t, `${P}upgrades_refused_total`, { reason: 'forbidden_address' }), 1)
      assert.equal(value(t, `${P}upgrades_refused_total`, { reason: 'not_found' }), 2)
      assert.equal(value(t, `${P}upgrades_refused_total`, { reason: 'bad_address' }), 1)
      const opened = parseExposition(t).filter((s) => s.name === `${P}sessions_total`).reduce((n, s) => n + s.value, 0)
      assert.equal(opened + value(t, `${P}sessions_active`), 0, 'a refused upgrade is not a session')
    })
  })

  test('refusals by origin and by session limits are counted under their own reasons', async () => {
    await withProxy({ allowedOrigins: ['https://app.example'], maxSessionsPerIp: 1 }, async (p) => {
      assert.equal(await upgradeStatus(p.ws('/v2'), { origin: 'https://evil.example' }), 403)
      const held = edgeClient(p.port)
      await within(10000, 'connect', held.connect())
      try {
        assert.equal(await upgradeStatus(p.ws('/v2')), 429)
      } finally {
        await held.end()
      }
      const t = await p.scrape()
      assert.equal(value(t, `${P}upgrades_refused_total`, { reason: 'origin' }), 1)
      assert.equal(value(t, `${P}upgrades_refused_total`, { reason: 'too_many_sessions_per_ip' }), 1)
    })
    await withProxy({ maxSessions: 1 }, async (p) => {
      const held = edgeClient(p.port)
      await within(10000, 'connect', held.connect())
      try {
        assert.equal(await upgradeStatus(p.ws('/v2')), 503)
      } finally {
        await held.end()
      }
      assert.equal(value(await p.scrape(), `${P}upgrades_refused_total`, { reason: 'too_many_sessions' }), 1)
    })
  })

  test('two proxies in one process keep separate metrics', async () => {
    await withProxy({}, async (a) => {
      await withProxy({}, async (b) => {
        await session(a.port)
        await eventually(() => a.logs.length === 1, 'the session log entry')
        assert.equal(value(await a.scrape(), `${P}sessions_total`, { outcome_kind: 'ok' }), 1)
        assert.equal(value(await b.scrape(), `${P}sessions_total`, { outcome_kind: 'ok' }), 0)
      })
    })
  })
})

describe('session log', () => {
  test('each way a session ends has its code: ok, refused (an auth failure), client error, handshake and idle timeouts, shutdown', async () => {
    const p = await startLocalProxy({ handshakeTimeoutMs: 300, idleTimeoutMs: 600 })
    try {
      const ended = (n: number) => eventually(() => p.logs.length === n, `session ${n} to be logged`)
      await session(p.port)
      await ended(1)
      await wrongPassword(p.port, 'not-the-password')
      await ended(2)
      const text = new WebSocket(p.ws('/v2'))
      text.once('open', () => text.send('hello'))
      await ended(3)
      new WebSocket(p.ws('/v2')).on('error', () => {}) // says nothing: the handshake timeout
      await ended(4)
      const idle = edgeClient(p.port)
      idle.on('error', () => {})
      await idle.connect() // then nothing: the idle timeout
      await ended(5)
      const last = edgeClient(p.port)
      last.on('error', () => {})
      await last.connect()
      await p.close(0)
      await ended(6)
      const kinds = p.logs.map((l) => [l.kind, l.authFailed])
      assert.deepEqual(kinds, [['ok', false], ['refused_by_postgres', true], ['client_error', false], ['timeout', false], ['timeout', false], ['shutdown', false]], p.logs.map((l) => l.outcome).join(' | '))
      assert.deepEqual(p.logs.slice(3).map((l) => l.outcome), ['startup not finished in time', 'idle timeout', 'edgepg-proxy is shutting down'])
      const metrics = await p.metrics!.registry.metrics()
      for (const kind of ['ok', 'refused_by_postgres', 'client_error', 'shutdown'] as const) assert.equal(value(metrics, `${P}sessions_total`, { outcome_kind: kind }), 1, kind)
      assert.equal(value(metrics, `${P}sessions_total`, { outcome_kind: 'timeout' }), 2)
      assert.equal(value(metrics, `${P}auth_failures_total`), 1)
    } finally {
      await p.close()
    }
  })

  test('one entry per session with peer, upstream, durationMs, bytesIn, bytesOut, outcome; never a password, query text or parameter', async () => {
    const marker = `obs-marker-${randomUUID()}`
    const wrong = `wrong-pw-${randomUUID()}`
    await withProxy({}, async (p) => {
      for (const role of ['scram_user', 'password_user'] as const) {
        const rows = await session(p.port, `SELECT 'text-${marker}' AS a, $1::text AS b`, [`param-${marker}`], role)
        assert.deepEqual(rows, [{ a: `text-${marker}`, b: `param-${marker}` }])
      }
      await wrongPassword(p.port, wrong)
      await eventually(() => p.logs.length === 3, 'one log entry per session')

      for (const entry of p.logs) {
        assert.deepEqual(Object.keys(entry).sort(), ['authFailed', 'bytesIn', 'bytesOut', 'database', 'durationMs', 'kind', 'outcome', 'peer', 'upstream', 'user'], `fields of ${JSON.stringify(entry)}`)
        assert.match(entry.peer, /127\.0\.0\.1/)
        assert.equal(entry.upstream, UPSTREAM)
        assert.ok(Number.isFinite(entry.durationMs) && entry.durationMs >= 0, `durationMs ${entry.durationMs}`)
        assert.ok(entry.bytesIn > 0 && entry.bytesOut > 0, `bytes ${entry.bytesIn}/${entry.bytesOut}`)
        assert.equal(typeof entry.outcome, 'string')
      }
      assert.deepEqual(p.logs.map((l) => [l.kind, l.authFailed]), [['ok', false], ['ok', false], ['refused_by_postgres', true]], p.logs.map((l) => l.outcome).join(' | '))
      const database = PG.database
      assert.deepEqual(p.logs.map((l) => [l.user, l.database]), [['scram_user', database], ['password_user', database], ['password_user', database]], 'who and where, as the login said')
      assert.match(p.logs[2].outcome, /^refused by Postgres: 28P01/)

      const text = JSON.stringify(p.logs)
      for (const secret of [PASSWORD, wrong, marker, 'text-', 'param-', 'SELECT']) assert.ok(!text.includes(secret), `"${secret}" appears in the session log: ${text}`)
    })
  })
})

test("a login in band (Neon's driver sends its startup over the open WebSocket) is logged with its user and database too, refused or not", async () => {
  const keys = ['webSocketConstructor', 'useSecureWebSocket', 'pipelineConnect', 'wsProxy'] as const
  const saved = Object.fromEntries(keys.map((k) => [k, neonConfig[k]]))
  await withProxy({}, async (p) => {
    Object.assign(neonConfig, { webSocketConstructor: WebSocket, useSecureWebSocket: false, pipelineConnect: false, wsProxy: () => `127.0.0.1:${p.port}/v2` })
    try {
      const { host, port, database } = PG
      const ok = new NeonClient({ host, port, database, user: 'scram_user', password: PASSWORD })
      await ok.connect()
      await ok.query('SELECT 1')
      await ok.end()
      const refused = new NeonClient({ host, port, user: 'password_user', password: 'wrong' })
      refused.on('error', () => {})
      await assert.rejects(refused.connect(), (err: any) => err.code === '28P01')
      await eventually(() => p.logs.length === 2, 'both sessions logged')
      assert.deepEqual(p.logs.map((l) => [l.kind, l.user, l.database]), [['ok', 'scram_user', database], ['refused_by_postgres', 'password_user', 'password_user']], 'the database defaults to the user, as in Postgres')
      assert.ok(!JSON.stringify(p.logs).includes(PASSWORD))
    } finally {
      Object.assign(neonConfig, saved)
    }
  })
})

test('--log-level: info logs every session, warn only those that did not end well, error neither (the line saying where it listens, always)', async () => {
  for (const [level, want] of [['info', ['ok', 'refused_by_postgres']], ['warn', ['refused_by_postgres']], ['error', []]] as const) {
    const p = await startChildProxy(UPSTREAM, { flags: ['--log-level', level] })
    try {
      await session(p.port)
      await wrongPassword(p.port, 'wrong')
      // A session that ends afterwards, logged at every level but error: once it is in, the two before it would be.
      const last = edgeClient(p.port, 'password_user', { password: 'wrong-again' })
      await assert.rejects(last.connect())
      await last.end().catch(() => {})
      if (level !== 'error') await eventually(() => p.logs.length >= want.length + 1, `the last session logged at ${level}`)
      else await new Promise((resolve) => setTimeout(resolve, 500))
      assert.deepEqual(p.logs.map((l) => l.kind), level === 'error' ? [] : [...want, 'refused_by_postgres'], `--log-level ${level}`)
      assert.ok(p.lines.some((l) => l.listening), 'where it listens')
    } finally {
      await p.stop()
    }
  }
})
