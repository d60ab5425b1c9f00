/**
 * A Worker's Durable Object holding a listening session (issue 50), in workerd via miniflare, with
 * the BUILT driver: it LISTENs by token through transaction pooling, hears NOTIFYs sent over TCP
 * between its requests, and is refused a channel the proxy's --listen-policy does not allow.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { readdirSync } from 'node:fs'
import { fileURLToPath } from 'node:url'
import { Miniflare } from 'miniflare'
import { startProxy, testPostgres, eventually, within, same } from './support/helpers'
import { token, tokenFixture } from './support/tokens'

const root = fileURLToPath(new URL('..', import.meta.url))
const TABLE = `do_notes_${process.pid}`
let fixture: Awaited<ReturnType<typeof tokenFixture>>
let byToken: Awaited<ReturnType<typeof startProxy>>
before(async () => {
  fixture = await tokenFixture(TABLE)
  byToken = await startProxy({ tokens: fixture.options, pool: { listenPolicy: fixture.listenPolicy } })
})
after(async () => {
  await byToken?.close()
  await fixture?.teardown()
})

test("a Durable Object keeps a listening session across requests: it hears what its policy allows, and is refused the rest", async () => {
  const { host, port, database } = testPostgres()
  const chunks = readdirSync(`${root}dist/chunks`).filter((f) => f.endsWith('.mjs'))
  const mf = new Miniflare({
    modulesRoot: root,
    modules: [
      { type: 'ESModule', path: `${root}test/workers/listening-object.mjs` },
      { type: 'ESModule', path: `${root}dist/index.mjs` },
      ...chunks.map((f) => ({ type: 'ESModule' as const, path: `${root}dist/chunks/${f}` })),
    ],
    compatibilityDate: '2026-04-01',
    durableObjects: { LISTENING: 'Listening' },
    bindings: { TOKEN_PROXY_PORT: String(byToken.port), DATABASE_URL: `postgres://${host}:${port}/${database}`, TOKEN: await token('alice', { seconds: 600 }) },
  })
  const call = async (path: string) => {
    const res = await within(15_000, path, mf.dispatchFetch(`http://object.test${path}`, { method: path === '/heard' ? 'GET' : 'POST' }))
    return { status: res.status, body: (await res.json()) as any }
  }
  try {
    same(await call('/listen?channel=user:alice'), { status: 200, body: { listening: true } }, 'LISTEN "user:alice"')
    same(await call('/listen?channel=user:bob'), { status: 500, body: { error: `permission denied to listen on "user:bob": the listen policy "public"."${TABLE}_may_listen" does not allow it for this token`, code: '42501' } }, 'LISTEN "user:bob"')
    // Sent between requests, over TCP: the object hears them while no request of its runs.
    await fixture.admin.query(`NOTIFY "user:bob", 'for bob'; NOTIFY "user:alice", 'first'`)
    await fixture.admin.query(`NOTIFY "user:alice", 'second'`)
    let heard: unknown[] = []
    await eventually(async () => (heard = (await call('/heard')).body).length >= 2, 'the object heard both')
    same(heard, [{ channel: 'user:alice', payload: 'first' }, { channel: 'user:alice', payload: 'second' }], 'what the object heard')
    same(await call('/end'), { status: 200, body: { ended: true } }, 'the session ended')
    await eventually(() => byToken.sessionCount === 0, 'its session closed')
  } finally {
    await mf.dispose()
  }
})
