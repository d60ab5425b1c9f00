/**
 * proxy/notify/listener.ts against the test Postgres: one backend listening for many channels,
 * registered before `listen` resolves, notifications as Postgres sends them, and a lost backend
 * reported at once and replaced by one that listens again.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import pg from 'pg'
import { serialize } from 'pg-protocol'
import { Listener, type Notification } from '../proxy/notify/listener'
import { loginAs } from '../proxy/login/in-upgrade'
import { parseStartupPacket } from '../proxy/wire/startup'
import { eventually, testPostgres, pgConfig } from './support/helpers'
import { PASSWORD } from './support/stack'

const APP = `edgepg-listener-${process.pid}`
const heard: Notification[] = []
const events: string[] = []
let listener: Listener
let sender: pg.Client

async function login() {
  const { host, port, database } = testPostgres()
  const startup = serialize.startup({ user: 'scram_user', database, application_name: APP })
  const { upstream, outcome } = await loginAs({ host, port }, undefined, { bytes: startup.length, first: parseStartupPacket(startup), password: PASSWORD, rest: Buffer.alloc(0) })
  if (outcome.kind !== 'ready') throw new Error(`the listener's login: ${outcome.kind}`)
  return upstream
}

before(async () => {
  listener = new Listener(login, { onNotification: (n) => heard.push(n), onLost: (err) => events.push(`lost: ${err.message}`), onRestored: () => events.push('restored') })
  sender = new pg.Client(pgConfig('scram_user'))
  await sender.connect()
})
after(async () => {
  await listener?.close()
  await sender?.end()
})

const notify = async (channel: string, payload: string) => (await sender.query('SELECT pg_notify($1, $2), pg_backend_pid() AS pid', [channel, payload])).rows[0].pid as number
const backends = async () => (await sender.query('SELECT pid FROM pg_stat_activity WHERE application_name = $1', [`edgepg-proxy listener: ${APP}`])).rows.map((r) => r.pid as number)

test('channels listened on one backend, registered once listen() resolves: a NOTIFY committed after it arrives, with its sender, channel and payload', async () => {
  const channels = ['orders', 'Mixed Case', 'with "quotes"', 'ünïcode']
  for (const channel of channels) await listener.listen(channel)
  assert.equal((await backends()).length, 1, 'one backend listens for them all')
  for (const channel of channels) {
    const pid = await notify(channel, `for ${channel}`)
    await eventually(() => heard.some((n) => n.channel === channel), `a notification on ${channel}`)
    assert.deepEqual(heard.find((n) => n.channel === channel), { pid, channel, payload: `for ${channel}` })
  }
})

test('after unlisten(), a channel is heard no more (notifications come in commit order: the next one proves it)', async () => {
  await listener.unlisten('orders')
  heard.length = 0
  await notify('orders', 'not heard')
  await notify('Mixed Case', 'heard')
  await eventually(() => heard.length > 0, 'the next notification')
  assert.deepEqual(heard.map((n) => n.payload), ['heard'])
})

test('a terminated backend: reported at once, replaced by one listening to every channel again', async () => {
  const [old] = await backends()
  await sender.query('SELECT pg_terminate_backend($1)', [old])
  await eventually(() => events.some((e) => e.startsWith('lost: ')), 'the loss reported')
  assert.match(events[0], /listening connection to Postgres .* was lost: notifications sent meanwhile were not delivered/)
  await eventually(() => events.includes('restored'), 'a new backend listening again', 10_000)
  const [now] = await backends()
  assert.ok(now && now !== old, `a new backend (${old} → ${now})`)
  heard.length = 0
  await notify('with "quotes"', 'after the loss')
  await eventually(() => heard.length > 0, 'a notification on the new backend')
  assert.deepEqual(heard.map((n) => [n.channel, n.payload]), [['with "quotes"', 'after the loss']])
})

test('close(): the backend goes, and nothing is reported lost', async () => {
  const lostBefore = events.filter((e) => e.startsWith('lost: ')).length
  await listener.close()
  await eventually(async () => (await backends()).length === 0, 'the listening backend gone')
  await new Promise((resolve) => setTimeout(resolve, 200))
  assert.equal(events.filter((e) => e.startsWith('lost: ')).length, lostBefore)
})
