/**
 * proxy/cluster/places.ts: limits counted for the whole proxy among --workers n. The primary's
 * keeper and each worker's side, with the IPC channels as ordered queues delivered on later ticks
 * (as node:cluster's are): a place is refused exactly when the whole proxy has none left, the bound
 * never breaks under concurrent takes, a key costs no message until a worker fills its share, and a
 * worker's death frees what it held without letting its replacement take more than the proxy has.
 */
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { LocalPlaces, PlacesKeeper, SharedPlaces, takeAll, type Places, type PlacesToPrimary, type PlacesToWorker } from '../proxy/cluster/places'
import { LoginGate } from '../proxy/login/gate'
import { within } from './support/helpers'

/** n workers and a keeper over ordered, asynchronous channels; `drain()` delivers everything in flight. */
function cluster(n: number, limit: number) {
  let inFlight = 0
  const messages = { toPrimary: 0 }
  const deliver = (fn: () => void) => {
    inFlight++
    setImmediate(() => (inFlight--, fn()))
  }
  const workers: SharedPlaces[] = []
  const keeper = new PlacesKeeper(n, (w, m: PlacesToWorker) => {
    const target = workers[w]
    deliver(() => {
      if (workers[w] !== target) return // (sent to a worker that died)
      if (m.op === 'known') for (const [, key, lease] of m.leases) target.lease(key, lease)
      else target.hear(m)
    })
  })
  const start = (w: number) => {
    const places: SharedPlaces = new SharedPlaces('test', limit, n, w, (m: PlacesToPrimary) => {
      messages.toPrimary++
      deliver(() => workers[w] === places && keeper.hear(w, m))
    })
    workers[w] = places
    keeper.hear(w, { edgepg: 'places', op: 'hello' })
  }
  for (let w = 0; w < n; w++) start(w)
  const drain = async () => {
    while (inFlight) await new Promise((r) => setImmediate(r))
  }
  const take = async (w: number, key = 'ip') => {
    const got = await workers[w].take(key)
    await drain()
    return got
  }
  return { workers, keeper, messages, drain, take, start }
}

test('a worker may hold the whole limit when the others hold none, and a place is refused only when the proxy has none', async () => {
  const c = cluster(2, 3) // shares: 2 and 1
  assert.deepEqual([await c.take(1), await c.take(1), await c.take(1)], [true, true, true], 'all three on the worker whose share is 1')
  assert.equal(await c.take(0), false, 'a fourth, on the other worker')
  assert.equal(await c.take(1), false, 'a fourth, on the same worker')
  c.workers[1].give('ip')
  await c.drain()
  assert.equal(await c.take(0), true, 'the place given back, taken on the other worker')
  assert.equal(await c.take(0), false)
})

test('within its share a worker asks nothing; once every place is given back, every worker has its share again', async () => {
  const c = cluster(2, 4)
  for (let i = 0; i < 2; i++) assert.equal(await c.take(0, 'a'), true)
  assert.equal(c.messages.toPrimary, 0, 'no message for places within the share')
  for (let i = 0; i < 4; i++) assert.equal(await c.take(1, 'b'), true) // past its share: asks
  assert.ok(c.messages.toPrimary > 0)
  for (let i = 0; i < 4; i++) c.workers[1].give('b')
  for (let i = 0; i < 2; i++) c.workers[0].give('a')
  await c.drain()
  assert.equal((c.keeper as any).tallies.get('test')?.size ?? 0, 0, 'the keeper forgets a key nobody holds')
  const before = c.messages.toPrimary
  for (let i = 0; i < 2; i++) assert.equal(await c.take(0, 'b'), true)
  for (let i = 0; i < 2; i++) assert.equal(await c.take(1, 'b'), true)
  assert.equal(c.messages.toPrimary, before, 'both shares of b back: taken without asking')
})

test('takes racing on three workers never hold more than the limit, and the refused come only when it is full', async () => {
  const limit = 7
  const c = cluster(3, limit)
  let held = 0
  let peak = 0
  let refusedBelow = 0
  const holding: number[] = []
  for (let round = 0; round < 40; round++) {
    // A burst of takes from random workers, answered in any order the channels allow.
    const burst = Array.from({ length: 1 + (round % 6) }, () => Math.floor(Math.random() * 3))
    await Promise.all(
      burst.map(async (w) => {
        if (await c.workers[w].take('ip')) {
          held++
          peak = Math.max(peak, held)
          holding.push(w)
        }
      })
    )
    await c.drain()
    // With nothing in flight, one more take is exact: refused if and only if the limit is reached.
    const w = round % 3
    const got = await c.take(w)
    if (got) held++, holding.push(w)
    else if (held < limit) refusedBelow++
    assert.ok(held <= limit, `${held} held, limit ${limit}`)
    // Give back some, from whichever worker holds them.
    for (let i = 0; i < round % 4 && holding.length; i++) {
      c.workers[holding.splice(Math.floor(Math.random() * holding.length), 1)[0]].give('ip')
      held--
    }
    await c.drain()
  }
  assert.ok(peak <= limit, `peak ${peak}, limit ${limit}`)
  assert.equal(refusedBelow, 0, 'no refusal while the proxy had a place')
  for (const w of holding.splice(0)) c.workers[w].give('ip')
  await c.drain()
  assert.equal((c.keeper as any).tallies.get('test')?.size ?? 0, 0)
})

test('a worker that dies frees what it held; its replacement starts with none of a counted key, so the limit still holds', async () => {
  const c = cluster(2, 4) // shares: 2 and 2
  for (let i = 0; i < 4; i++) assert.equal(await c.take(0), true, 'worker 0 holds all four')
  assert.equal(await c.take(1), false)
  c.keeper.gone(1)
  c.start(1) // the replacement says hello
  await c.drain()
  assert.equal(await c.take(1), false, 'the replacement may not take its share: worker 0 holds it')
  c.workers[0].give('ip')
  await c.drain()
  assert.equal(await c.take(1), true)
  // Now worker 0 dies holding three: its places are free again.
  c.keeper.gone(0)
  c.start(0)
  await c.drain()
  assert.deepEqual([await c.take(1), await c.take(1), await c.take(1)], [true, true, true])
  assert.equal(await c.take(0), false, 'four held, by worker 1')
})

test('takeAll: a place in each, or none (giving back what it took before the full one)', async () => {
  const c = cluster(2, 1) // shares: 1 and 0
  const total = c.workers[0]
  assert.equal(await takeAll([[total, ''], [total, 'ip']]), -1)
  assert.equal(await takeAll([[total, 'x'], [total, 'ip']]), 1, 'ip is full: x is given back')
  assert.equal(await c.take(0, 'x'), true, 'x was given back')
})

test('LoginGate: a place freed in another worker reaches a waiting login, however often others arrive', async () => {
  // Address a's one place is held elsewhere until 50 ms in; address c never has one, and arrives every 20 ms.
  let heldElsewhere = 1
  const perIp: Places = {
    take: (key) => (key === 'a' ? Promise.resolve(heldElsewhere < 1 && ++heldElsewhere > 0) : false),
    give: () => {},
  }
  const gate = new LoginGate(100, 1, (name, limit) => (name === 'loginsPerIp' ? perIp : new LocalPlaces(limit)))
  const waiting = gate.admit('a')
  const arrivals = setInterval(() => gate.admit('c'), 20)
  setTimeout(() => (heldElsewhere = 0), 50)
  try {
    await within(1000, 'the login of a, once its place is free elsewhere', waiting.admitted)
  } finally {
    clearInterval(arrivals)
  }
})
