/**
 * Cloudflare Workers, for real: the BUILT bundle (dist/index.mjs and its dist/chunks/, passed to
 * miniflare as ES modules, unchanged) runs in workerd, with and without the nodejs_compat flag.
 * test/workers/worker.mjs creates, uses and ends its Client / Pool inside each request (Workers
 * forbid I/O objects crossing requests) and closes them in ctx.waitUntil; it also runs httpSql
 * against the proxy's POST /sql. Several requests in a row must all succeed with the right rows,
 * and afterwards no Postgres backend may be left behind. The WebSockets go to an in-process
 * edgepg-proxy on ws://127.0.0.1:<port>, relaying to the test Postgres; `npm test` builds dist/ first.
 * Then a read right after a write, by another Client, through a proxy with --replica (a primary of
 * this file's own, its standby lagging 300 ms).
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { readdirSync } from 'node:fs'
import { fileURLToPath } from 'node:url'
import { Miniflare } from 'miniflare'
import { startProxy, testPostgres, backends, eventually, within, same } from './support/helpers'
import { PASSWORD } from './support/stack'
import { token, tokenFixture, WEB_USER } from './support/tokens'
import { replicaFixture } from './support/standby'

const root = fileURLToPath(new URL('..', import.meta.url))
const APP = `edgepg-workers-${process.pid}`
const REQUESTS = 5
const COMPATIBILITY_DATE = '2026-04-01'

let proxy: Awaited<ReturnType<typeof startProxy>>
/** Logins by token: a proxy taking them, and the table of rows per user (test/support/tokens.ts). */
let byToken: Awaited<ReturnType<typeof startProxy>>
let fixture: Awaited<ReturnType<typeof tokenFixture>>
/** A primary of its own with a standby lagging 300 ms, and a proxy reading from it. */
let replicas: Awaited<ReturnType<typeof replicaFixture>>
let withReplica: Awaited<ReturnType<typeof startProxy>>
const TABLE = `workers_notes_${process.pid}`
before(async () => {
  proxy = await startProxy()
  fixture = await tokenFixture(TABLE)
  byToken = await startProxy({ tokens: fixture.options })
  replicas = await replicaFixture('workers-primary')
  withReplica = await startProxy({ upstream: replicas.upstream, replicas: replicas.replicas })
})
after(async () => {
  await proxy?.close()
  await byToken?.close()
  await withReplica?.close()
  await fixture?.teardown()
  await replicas?.teardown()
})

function worker(nodejsCompat: boolean) {
  const { host, port, database } = testPostgres()
  const chunks = readdirSync(`${root}dist/chunks`).filter((f) => f.endsWith('.mjs'))
  return new Miniflare({
    modulesRoot: root,
    modules: [
      { type: 'ESModule', path: `${root}test/workers/worker.mjs` },
      { type: 'ESModule', path: `${root}dist/index.mjs` },
      ...chunks.map((f) => ({ type: 'ESModule' as const, path: `${root}dist/chunks/${f}` })),
    ],
    compatibilityDate: COMPATIBILITY_DATE,
    compatibilityFlags: nodejsCompat ? ['nodejs_compat'] : [],
    bindings: {
      PROXY_PORT: String(proxy.port),
      DATABASE_URL: `postgres://scram_user:${encodeURIComponent(PASSWORD)}@${host}:${port}/${database}`,
      APP,
      TOKEN_PROXY_PORT: String(byToken.port),
      TABLE,
      REPLICA_PROXY_PORT: String(withReplica.port),
      REPLICA_DATABASE_URL: `postgres://scram_user:${encodeURIComponent(PASSWORD)}@${replicas.upstream}/postgres`,
    },
  })
}

for (const nodejsCompat of [false, true]) {
  test(`Worker in workerd ${nodejsCompat ? 'with' : 'without'} nodejs_compat: Client, Pool and httpSql, ${REQUESTS} requests each; reads on a replica right after writes`, async () => {
    const mf = worker(nodejsCompat)
    try {
      await within(30_000, 'miniflare ready', mf.ready)
      for (const mode of ['client', 'pool', 'http'] as const) {
        for (let i = 0; i < REQUESTS; i++) {
          const n = 10 * i + 1
          const res = await within(15_000, `${mode} request ${i}`, mf.dispatchFetch(`http://worker.test/?mode=${mode}&n=${n}`))
          const body: any = await res.json()
          assert.equal(res.status, 200, `${mode} request ${i} failed in workerd: ${JSON.stringify(body)}`)
          // application_name shows the connection is the Worker's own; /sql logs in as a default pg Client (none).
          const app = mode === 'http' ? '' : `${APP}-${mode}`
          const expected = [{ doubled: 2 * n, mode, who: 'scram_user', app }]
          if (mode === 'pool') expected.push({ doubled: 2 * (n + 1), mode, who: 'scram_user', app })
          same(body.rows, expected, `${mode} request ${i} rows`)
          assert.equal(body.userAgent, 'Cloudflare-Workers', `navigator.userAgent in workerd is ${body.userAgent}`)
          assert.equal(body.hasProcess, nodejsCompat ? 'object' : 'undefined', `typeof process with nodejs_compat=${nodejsCompat}`)
        }
        // Every connection the Worker opened was closed via ctx.waitUntil: no session is left open
        // (its backend goes back to the proxy's pool, idle; they go with the proxy, last test).
        await eventually(() => proxy.sessionCount === 0, `no ${mode} session left open`)
      }
      // By token: each request its user's, over a WebSocket and over HTTP, and only their rows.
      for (const who of ['alice', 'bob', 'alice']) {
        const res = await within(15_000, `token request for ${who}`, mf.dispatchFetch(`http://worker.test/?mode=token&token=${await token(who)}`))
        const body: any = await res.json()
        assert.equal(res.status, 200, `token request for ${who} failed in workerd: ${JSON.stringify(body)}`)
        const row = { sub: who, who: WEB_USER, owners: [who] }
        same(body.rows, [row, row], `token request for ${who}`)
      }
      await eventually(() => byToken.sessionCount === 0, 'no token session left open')
      // A read right after a write (another Client's) on the lagging replica sees the write.
      for (let i = 0; i < 2; i++) {
        const res = await within(15_000, `replica request ${i}`, mf.dispatchFetch('http://worker.test/?mode=replica'))
        const body: any = await res.json()
        assert.equal(res.status, 200, `replica request ${i} failed in workerd: ${JSON.stringify(body)}`)
        const [{ written, ...read }] = body.rows
        same(read, { n: written, replica: true, protocol: 'edgepg.v5' }, `replica request ${i}: the read sees the write, on the replica, its position told in the query's own message`)
      }
    } finally {
      await mf.dispose()
    }
    await eventually(() => proxy.sessionCount === 0, 'every proxy WebSocket session closed')
  })
}

test('after the proxy closes, its pool leaves no backend either', async () => {
  await proxy.close()
  await byToken.close()
  // (scram_user's: backends for tokens, other test files' among them, log in as other roles.)
  await eventually(async () => (await backends('', undefined, 'scram_user')) === 0, 'no /sql backend left')
  await eventually(async () => (await backends(`${APP}-client`)) + (await backends(`${APP}-pool`)) === 0, 'no Worker backend left (the pool closed with the proxy)')
})
