/**
 * Channels authorized by Postgres (issue 50): a token session may LISTEN only where the operator's
 * function (--listen-policy), run as the token's role with its claims, says so; without a policy,
 * not at all; password sessions keep Postgres's rule. Tried as the holder of a valid token would
 * try to get around it: by database code, by its own settings, by asking again.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { WebSocket } from 'ws'
import { Client, type ClientConfig } from '../src/index'
import { startProxy, eventually, edgeClient, testPostgres } from './support/helpers'
import { token, tokenFixture, WEB_USER } from './support/tokens'

const TABLE = `listen_notes_${process.pid}`
const SCHEMA = `listen_policy_${process.pid}`
let fx: Awaited<ReturnType<typeof tokenFixture>>
before(async () => {
  fx = await tokenFixture(TABLE)
  // A user may hear "user:<their sub>" and "news"; each call counted (the policy is asked once per channel and session).
  await fx.admin.query(`CREATE SCHEMA ${SCHEMA}`)
  await fx.admin.query(`CREATE SEQUENCE ${SCHEMA}.calls`)
  await fx.admin.query(`CREATE FUNCTION ${SCHEMA}.may_listen(channel text) RETURNS boolean LANGUAGE sql AS $$
    SELECT nextval('${SCHEMA}.calls') > 0 AND (channel = 'news' OR channel = 'user:' || (edgepg.claims() ->> 'sub')) AND current_user = '${WEB_USER}' $$`)
  // One that fails until a row says it may decide.
  await fx.admin.query(`CREATE TABLE ${SCHEMA}.ready (ok boolean)`)
  await fx.admin.query(`CREATE FUNCTION ${SCHEMA}.flaky(channel text) RETURNS boolean LANGUAGE plpgsql AS $$
    BEGIN IF NOT EXISTS (SELECT FROM ${SCHEMA}.ready) THEN RAISE EXCEPTION 'not ready'; END IF; RETURN true; END $$`)
  await fx.admin.query(`GRANT SELECT ON ${SCHEMA}.ready TO ${WEB_USER}`)
  await fx.admin.query(`GRANT USAGE ON SCHEMA ${SCHEMA} TO ${WEB_USER}`)
  await fx.admin.query(`GRANT USAGE ON SEQUENCE ${SCHEMA}.calls TO ${WEB_USER}`)
})
after(async () => {
  await fx?.admin.query(`DROP SCHEMA IF EXISTS ${SCHEMA} CASCADE`).catch(() => {})
  await fx?.teardown()
})

type Proxy = Awaited<ReturnType<typeof startProxy>>
const policyProxy = (listenPolicy?: string) => startProxy({ tokens: fx.options, pool: { mode: 'transaction', size: 2, timeoutMs: 2000, listenPolicy } })

type Heard = { channel: string; payload?: string }
async function as(p: Proxy, sub: string): Promise<Client & { heard: Heard[] }> {
  const { host, port, database } = testPostgres()
  const config: ClientConfig = { host, port, database, authToken: await token(sub), webSocketConstructor: WebSocket as any, wsProxy: () => p.url }
  const client = Object.assign(new Client(config), { heard: [] as Heard[] })
  client.on('error', () => {})
  client.on('notification', ({ channel, payload }) => client.heard.push({ channel, payload }))
  await client.connect()
  return client
}

const notify = (channel: string, payload: string) => fx.admin.query('SELECT pg_notify($1, $2)', [channel, payload])
const calls = async () => Number((await fx.admin.query(`SELECT last_value FROM ${SCHEMA}.calls`)).rows[0].last_value)
const channelsOf = async (c: Client) => (await c.query("SELECT coalesce(array_agg(c ORDER BY c), '{}') AS l FROM pg_listening_channels() c")).rows[0].l

test('a token session listens where the policy allows, as its role with its claims, and is refused elsewhere with 42501', async () => {
  const p = await policyProxy(`${SCHEMA}.may_listen`)
  const [alice, bob] = [await as(p, 'alice'), await as(p, 'bob')]
  try {
    await alice.query('LISTEN "user:alice"')
    await alice.query('LISTEN news')
    await bob.query('LISTEN "user:bob"')
    await assert.rejects(alice.query('LISTEN "user:bob"'), (err: Error & { code?: string }) => {
      assert.equal(err.code, '42501')
      assert.match(err.message, new RegExp(`permission denied to listen on "user:bob": the listen policy "${SCHEMA}"."may_listen" does not allow it for this token`))
      return true
    })
    assert.deepEqual(await channelsOf(alice), ['news', 'user:alice'], 'the refused channel is not hers, on her backend either')
    await notify('user:bob', 'for bob')
    await notify('user:alice', 'for alice')
    await notify('news', 'for all')
    await eventually(() => alice.heard.length === 2 && bob.heard.length === 1, 'the notifications')
    assert.deepEqual(alice.heard, [{ channel: 'user:alice', payload: 'for alice' }, { channel: 'news', payload: 'for all' }])
    assert.deepEqual(bob.heard, [{ channel: 'user:bob', payload: 'for bob' }])
  } finally {
    await Promise.all([alice.end(), bob.end()])
    await p.close()
  }
})

test('asked once per channel and session; a refusal stands, whatever the session tries: database code, its settings, again', async () => {
  const p = await policyProxy(`${SCHEMA}.may_listen`)
  const mallory = await as(p, 'mallory')
  try {
    const before = await calls()
    for (let i = 0; i < 3; i++) await mallory.query('LISTEN "user:mallory"; UNLISTEN "user:mallory"; LISTEN "user:mallory"')
    assert.equal((await calls()) - before, 1, 'one call for the channel')
    // By database code (no LISTEN tag): still the policy's.
    await assert.rejects(mallory.query(`DO $$ BEGIN EXECUTE 'LISTEN "user:alice"'; END $$`), { code: '42501' })
    // Her own settings and search_path are not where the policy runs.
    await mallory.query(`SET search_path = pg_temp, public`)
    await mallory.query(`SELECT set_config('request.jwt.claims', '{"sub":"alice"}', false)`)
    await assert.rejects(mallory.query('LISTEN "user:alice"'), { code: '42501' })
    assert.deepEqual(await channelsOf(mallory), ['user:mallory'])
    await notify('user:alice', 'secret')
    await notify('user:mallory', 'hers')
    await eventually(() => mallory.heard.length === 1, 'her own')
    assert.deepEqual(mallory.heard, [{ channel: 'user:mallory', payload: 'hers' }], 'nothing of alice')
  } finally {
    await mallory.end()
    await p.close()
  }
})

test('without --listen-policy a token session may not LISTEN; a password session may, anywhere, without the policy asked', async () => {
  const p = await policyProxy()
  const alice = await as(p, 'alice')
  try {
    await assert.rejects(alice.query('LISTEN news'), (err: Error & { code?: string }) => err.code === '42501' && /--listen-policy schema\.function/.test(err.message))
    await assert.rejects(alice.query(`DO $$ BEGIN EXECUTE 'LISTEN news'; END $$`), { code: '42501' })
    assert.deepEqual(await channelsOf(alice), [])
    const before = await calls()
    const password = edgeClient(p.port)
    password.on('notification', ({ payload }) => alice.heard.push({ channel: 'password', payload }))
    await password.connect()
    await password.query('LISTEN "user:alice"')
    await notify('user:alice', 'heard by the password session')
    await eventually(() => alice.heard.length === 1, 'the password session hears')
    assert.equal(await calls(), before)
    await password.end()
  } finally {
    await alice.end()
    await p.close()
  }
})

test('a policy that fails refuses that LISTEN, and is asked again next time: no failure is kept as its decision', async () => {
  const p = await policyProxy(`${SCHEMA}.flaky`)
  const alice = await as(p, 'alice')
  try {
    await assert.rejects(alice.query('LISTEN news'), (err: Error & { code?: string }) => {
      assert.equal(err.code, '42501')
      assert.match(err.message, new RegExp(`permission denied to listen on "news": the listen policy "${SCHEMA}"."flaky" failed: not ready`))
      return true
    })
    await fx.admin.query(`INSERT INTO ${SCHEMA}.ready VALUES (true)`)
    await alice.query('LISTEN news')
    await notify('news', 'now')
    await eventually(() => alice.heard.length === 1, 'heard')
  } finally {
    await alice.end()
    await p.close()
  }
})
